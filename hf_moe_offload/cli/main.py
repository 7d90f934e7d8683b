"""`hf-moe-offload` command line. Each subcommand lives with the feature it drives and registers itself here."""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import add_debug_flag, run_reporting_errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-moe-offload", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    # Import lazily so that `hf-moe-offload --help` stays fast.
    from ..fairseq import convert
    from ..hub import adapter_check, adapter_serving, upload
    from . import estimate, generate, train

    train.add_cli(sub)
    estimate.add_cli(sub)
    generate.add_cli(sub)
    convert.add_cli(sub)
    upload.add_cli(sub)
    adapter_serving.add_cli(sub)
    adapter_check.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a subcommand; returns the exit code (2 for an error of the user's, printed as one line)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_reporting_errors(lambda: args.func(args), "hf-moe-offload", args.debug)
    finally:
        # Under `accelerate launch`: tear the process group down before exit (gloo may abort otherwise).
        from ..distributed import end_process_groups

        end_process_groups()


if __name__ == "__main__":
    sys.exit(main())
