"""``python -m thunder_overlap {demo,report} ...``"""

from __future__ import annotations

import sys

COMMANDS = ("demo", "report")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m thunder_overlap {{{','.join(COMMANDS)}}} [options]  (got {argv[:1] or 'nothing'})", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from thunder_overlap.tools.demo import main as demo_main

        return demo_main(rest)
    if command == "report":
        from thunder_overlap.report.cli import main as report_main

        return report_main(rest)
    raise AssertionError(command)


if __name__ == "__main__":
    sys.exit(main())
