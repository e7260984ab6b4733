"""``python -m thunder_overlap {demo,report} ...``; ``--help`` lists the commands, ``--version``
prints the package version. A command runs with Thunder's known import warnings dropped
(:func:`thunder_overlap._console.known_warnings_ignored`): they say nothing to its user."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from thunder_overlap._console import known_warnings_ignored

__all__ = ["COMMANDS", "main"]


@dataclass(frozen=True)
class Command:
    summary: str
    # "module:function" taking the remaining arguments and returning an exit status.
    entry: str


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "train TinyGPT on 2 gloo ranks with Thunder's FSDP and with thunder_overlap, side by side", "thunder_overlap.testing.demo:main"
    ),
    "report": Command(
        "predict overlap, step time and memory of a model at any world size, without a GPU", "thunder_overlap.report._cli:main"
    ),
}
# Exit status for a command line that names no known command (argparse's convention).
USAGE_ERROR = 2


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m thunder_overlap [--help] [--version] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    lines += ["", "python -m thunder_overlap COMMAND --help describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatches to a command; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from thunder_overlap import __version__

        print(f"thunder_overlap {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"{usage()}\n\nerror: unknown command {argv[0]!r}; accepted: {', '.join(COMMANDS)}", file=sys.stderr)
        return USAGE_ERROR
    module, function = command.entry.split(":")
    with known_warnings_ignored():
        return getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
