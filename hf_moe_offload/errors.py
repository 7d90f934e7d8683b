"""The package's expected failures, and how the command line reports them.

Every error the user can act on derives from `HFMoEOffloadError` and lives here, so that any module can raise them
without importing the module that raises them most (no import circles): `UserError` where the input is wrong (a flag,
a file, a directory); `CheckpointError` (a corrupt, incomplete or foreign checkpoint, a save that failed);
`ExpertStoreError` (an expert file that fails its checksum, a full disk, an offload directory in use; its kinds are in
offload/stores/store.py); `FairseqConversionError` (a fairseq checkpoint that cannot be converted). Each message names the
problem and the fix. The CLI and the recipes print them as one line and exit with code 2; `--debug` shows the
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


class HFMoEOffloadError(Exception):
    """Base of the package's expected failures: the message says what is wrong and what to do."""


class UserError(HFMoEOffloadError, ValueError):
    """Bad input: the message says what is wrong and what to do."""


class CheckpointError(HFMoEOffloadError, RuntimeError):
    """A checkpoint that cannot be read or written as asked (corrupt, incomplete, of another model; a full disk)."""


class ExpertStoreError(HFMoEOffloadError, RuntimeError):
    """Base class of the expert store's errors (offload/stores/store.py)."""


class FairseqConversionError(HFMoEOffloadError, ValueError):
    """A fairseq checkpoint that cannot be converted; the message names the file and the fix."""


def add_debug_flag(parser, subcommand: bool = False) -> None:
    """`--debug`; on a subcommand's parser it only sets the value when given (the top parser holds the default)."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS if subcommand else False,
                        help="show the full traceback of an error (errors are otherwise one line, exit code 2)")


def run_reporting_errors(fn: Callable[[], object], prog: str, debug: bool) -> int:
    """Run `fn`; a user error becomes one line on stderr and exit code 2 (re-raised with `debug`)."""
    try:
        fn()
    except HFMoEOffloadError as err:
        if debug:
            raise
        logging.getLogger(__name__).debug("error", exc_info=True)
        message = " ".join(str(err).split("\n"))
        print(f"{prog}: error: {message} (--debug shows the traceback)", file=sys.stderr, flush=True)
        return 2
    return 0


__all__ = ["CheckpointError", "ExpertStoreError", "FairseqConversionError", "HFMoEOffloadError", "UserError",
           "add_debug_flag", "run_reporting_errors"]
