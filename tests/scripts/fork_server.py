"""Runs many short Python programs as forked children of one process that imported the heavy modules once.

python tests/scripts/fork_server.py [MODULE ...]     # imports MODULEs, then serves runs read from stdin

Each stdin line is a JSON run `{"argv": [SCRIPT, ARG, ...] or ["-m", MODULE, ARG, ...], "log": PATH}`: the server
forks, the child runs it as `python SCRIPT ARG...` would (`__main__`, sys.argv, exit code), with stdout and stderr
going to PATH, and the server answers one JSON line `{"returncode": N}` as `subprocess` reports it (-9: killed by
SIGKILL). Each run is a process of its own that shares no run state with the others; only the imports are shared.
A test of many short runs pays the import of transformers' Trainer, peft and bitsandbytes (most of a short run's
time) once. `tests/fork_runs.py` is the test side.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from typing import Callable


def _run_child(run: dict, prepare: Callable[[dict], None] | None) -> int:
    fd = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if prepare is not None:
        prepare(run)
    argv = list(run["argv"])
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


def serve(modules=(), prepare: Callable[[dict], None] | None = None) -> None:
    """Import `modules`, then one forked child per stdin line; `prepare(run)` runs in the child before the program."""
    for name in modules:
        importlib.import_module(name)
    for line in sys.stdin:
        run = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: one run, then gone without the parent's exit handlers
            code = 1
            try:
                code = _run_child(run, prepare)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"returncode": code}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1:])
