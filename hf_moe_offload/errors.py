"""Errors that are the user's to fix, and how the command line reports them.

`UserError` is raised where the input is wrong (a flag, a file, a directory, a checkpoint); its message names the
problem and the fix. The CLI and the recipes print such errors, and the package's other expected failures
(`CheckpointError`, `ExpertStoreError`: a corrupt or incomplete checkpoint, an expert file that fails its checksum, a
full disk, an offload directory in use) as one line and exit with code 2; `--debug` shows the traceback. Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


class UserError(ValueError):
    """Bad input: the message says what is wrong and what to do."""


def user_error_types() -> tuple[type[BaseException], ...]:
    from .fairseq.convert import FairseqConversionError
    from .offload.checkpoint import CheckpointError
    from .offload.store import ExpertStoreError

    return (UserError, CheckpointError, ExpertStoreError, FairseqConversionError)


def add_debug_flag(parser, subcommand: bool = False) -> None:
    """`--debug`; on a subcommand's parser it only sets the value when given (the top parser holds the default)."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS if subcommand else False,
                        help="show the full traceback of an error (errors are otherwise one line, exit code 2)")


def run_reporting_errors(fn: Callable[[], object], prog: str, debug: bool) -> int:
    """Run `fn`; a user error becomes one line on stderr and exit code 2 (re-raised with `debug`)."""
    try:
        fn()
    except user_error_types() as err:
        if debug:
            raise
        logging.getLogger(__name__).debug("error", exc_info=True)
        message = " ".join(str(err).split("\n"))
        print(f"{prog}: error: {message} (--debug shows the traceback)", file=sys.stderr, flush=True)
        return 2
    return 0


__all__ = ["UserError", "user_error_types", "add_debug_flag", "run_reporting_errors"]
