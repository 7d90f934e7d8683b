"""The test side of tests/scripts/fork_server.py: short runs of scripts as forked children of one process that
imported the heavy modules once (each run still a process of its own, with its own exit code and output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, "tests", "scripts", "fork_server.py")


class ForkRuns:
    """`server`: the command that serves (default: fork_server.py importing `modules`)."""

    def __init__(self, modules=(), server=None, env=None):
        self.proc = subprocess.Popen(server or [sys.executable, SERVER, *modules], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))

    def run(self, argv, log, check=True, **extra) -> tuple[int, str]:
        """Run `argv` (as after `python`), its output to `log`; returns (exit code, output)."""
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "log": str(log), **extra}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the fork server died (exit {self.proc.poll()})"
        code = json.loads(line)["returncode"]
        with open(log) as f:
            text = f.read()
        if check:
            assert code == 0, text[-8000:]
        return code, text

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
