"""Runs the Python blocks of documentation pages as a reader runs them: each page in a process of its own, its blocks
in order in one namespace (a page's later block may use what an earlier one defined), in a working directory of its
own. Called by tests/test_docs.py with a JSON file:

    [{"page": "docs/lora.md", "cwd": "/tmp/.../lora", "blocks": [[first_line, source], ...]}, ...]

The heavy imports (torch, transformers, peft, datasets, accelerate, the package) happen once here; each page then
runs in a child forked from this process, so pages share the import time but no Python state. This process runs no
tensor operation before forking: a forked child starts with no thread pool of its parent's to inherit.

Prints one line per page, `PAGE <path> ok` or `PAGE <path> FAILED`, then each failure's traceback (line numbers are
the page's own) at the end, after whatever the pages printed; exits 1 if any page failed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

TRACEBACK = "page-traceback.txt"  # written in the page's folder by a page that fails


def run_page(page: dict) -> None:
    os.chdir(page["cwd"])
    namespace = {"__name__": "__main__"}
    for first_line, source in page["blocks"]:
        # Blank lines in front so that a traceback's line numbers are the markdown page's.
        code = compile("\n" * first_line + source, page["page"], "exec")
        exec(code, namespace)


def main(spec_path: str) -> int:
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import hf_moe_offload  # noqa: F401

    with open(spec_path, encoding="utf-8") as f:
        pages = json.load(f)
    failed = []
    for page in pages:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_page(page)
            except BaseException:
                with open(os.path.join(page["cwd"], TRACEBACK), "w", encoding="utf-8") as f:
                    f.write(traceback.format_exc())
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        ok = os.waitstatus_to_exitcode(status) == 0
        print(f"PAGE {page['page']} {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(page)
    for page in failed:
        path = os.path.join(page["cwd"], TRACEBACK)
        why = open(path, encoding="utf-8").read() if os.path.exists(path) else "killed, or exited without a traceback"
        print(f"\n{page['page']} FAILED:\n{why}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
