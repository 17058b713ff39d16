"""The ``undying`` command."""

from __future__ import annotations

import argparse
import atexit
import gc
import sys
from typing import NoReturn

from undying import __version__
from undying.cli import (
    chaos,
    checkpoints,
    demo,
    diagnose,
    inject,
    k8s,
    manager,
    run,
    slurm,
    status,
    trace,
)
from undying.cli import migrate as moves
from undying.config import show_launcher_log
from undying.errors import UsageError

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with its own errors in one line: the message and where the options are, not the
    usage.

    A refused input is then one line on stderr and exit 2 whichever check refused it (argparse's
    own, such as ``--job-id -rf`` taken as a missing value, an option's type, or the command's),
    so scripts and people read the same short answer. Subcommands inherit the class.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(
        prog="undying",
        # (an abbreviation after `run SCRIPT` is the script's, never --verbose's)
        allow_abbrev=False,
        description="Fault-tolerant distributed PyTorch training: survivors keep their state, "
        "dead ranks are replaced, only the step in flight is re-run.",
    )
    parser.add_argument("--version", action="version", version=f"undying {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log more (to stderr): every INFO line, the ranks' own too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run.add_parser(sub)
    manager.add_parser(sub)
    status.add_parser(sub)
    checkpoints.add_parser(sub)
    inject.add_parser(sub)
    moves.add_parsers(sub)  # migrate, drain, undrain
    demo.add_parser(sub)
    chaos.add_parser(sub)
    trace.add_parser(sub)
    diagnose.add_parser(sub)
    k8s.add_parser(sub)
    slurm.add_parser(sub)
    return parser


_exit_hook: list[bool] = []


def _quick_exit() -> None:
    """Skip collecting torch's object graph at interpreter shutdown (0.4 s of CPU a process,
    measured).

    Registered once, before anything else, so it runs after every other exit handler.
    """
    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(gc.freeze)


def main(argv: list[str] | None = None) -> int:
    _quick_exit()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:  # raised by an argument's own type check
        sys.stderr.write(f"undying: error: {e}\n")
        return 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    # WARNING and the INFO lines people read (a recovery's), or every INFO line with -v.
    show_launcher_log(args.verbose)
    try:
        return int(args.func(args))
    except UsageError as e:
        sys.stderr.write(f"undying: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
