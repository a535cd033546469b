"""The `leap` command. Each subcommand lives in leap/commands/<name>.py and registers itself
through `add_parser(subparsers)`; the list below is the only place to add one."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from leap import __version__

COMMANDS = ["serve", "up", "health", "conformance", "bootstrap-model", "demo", "eval", "dcp-experiment", "expand-compress"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leap",
        description="LEAP suite: RL post-training of code LLMs on low-level kernels, as gRPC services.",
    )
    parser.add_argument("--version", action="version", version=f"leap {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"leap.commands.{name.replace('-', '_')}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command != "serve":  # a service stops on SIGTERM its own way (drain, then grace)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(args.func(args, extra) or 0)
    except Terminated:  # the stack a command started is stopped on the way out, as on Ctrl-C
        return 143
    except KeyboardInterrupt:
        return 130
    except UserError as err:  # a person typed something wrong: one friendly line, no traceback
        print(f"leap {args.command}: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a service's status reached the command: its code and reason, one line
        from leap.runtime.errors import call_failure

        failure = call_failure(err) if args.command != "serve" else None
        if failure is None:
            raise
        print(f"leap {args.command}: {failure}", file=sys.stderr)
        return 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C is: whatever stops on Ctrl-C stops on it too."""


def _terminated(*_) -> None:
    """SIGTERM as Ctrl-C: the command unwinds, so every service it started is stopped (the
    default action would end this process alone and leave them running)."""
    raise Terminated


class UserError(Exception):
    """A mistake in what the user asked for, reported as one line."""
