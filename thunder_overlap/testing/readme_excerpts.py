"""README excerpts rendered from real runs, so they cannot go stale.

    python -m thunder_overlap.testing.readme_excerpts            # rewrite the excerpts
    python -m thunder_overlap.testing.readme_excerpts --check    # exit 1 with a diff if stale

Each excerpt is the stdout of one ``python -m thunder_overlap ...`` command, kept in README.md (or
a page of docs/) as a fenced block between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``. Lines holding measured
times (they start with the demo's ``MEASURED_PREFIX``) are compared with their numbers masked;
every other line must match exactly. ``tests/test_readme.py`` runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from thunder_overlap._console import KNOWN_WARNINGS, without_known_output

__all__ = ["EXCERPTS", "Excerpt", "check", "failure_output", "masked", "read_block", "render", "replace_block"]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
FENCE = "```"
# argparse wraps --help to the terminal width; a fixed width makes the text the same everywhere.
HELP_COLUMNS = "100"
# Seconds one command may take before rendering gives up (the demo takes about a minute idle).
COMMAND_TIMEOUT_S = 900.0
_NUMBER = re.compile(r"\d+(\.\d+)?")


@dataclass(frozen=True)
class Excerpt:
    name: str  # the marker name in the document
    argv: tuple[str, ...]  # arguments after ``python -m thunder_overlap``
    measured_prefix: str | None = None  # lines starting with it hold numbers that vary between runs
    document: Path = README  # the file that holds the excerpt

    @property
    def command(self) -> str:
        return " ".join(("python -m thunder_overlap", *self.argv))


def _demo_measured_prefix() -> str:
    from thunder_overlap.testing.demo import MEASURED_PREFIX

    return MEASURED_PREFIX


EXCERPTS: tuple[Excerpt, ...] = (
    Excerpt("demo-output", ("demo",), _demo_measured_prefix()),
    Excerpt("cli-help", ("--help",)),
    Excerpt("report-help", ("report", "--help"), document=DESIGN),
)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def render(excerpt: Excerpt, *, python: str = sys.executable) -> str:
    """Runs the excerpt's command; returns its stdout. Raises if it fails or prints known
    third-party chatter (which the commands are meant to filter)."""
    env = {**os.environ, "COLUMNS": HELP_COLUMNS}
    done = subprocess.run(
        [python, "-m", "thunder_overlap", *excerpt.argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=COMMAND_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"`{excerpt.command}` exited with {done.returncode}:\n{failure_output(done.stderr)}")
    printed = done.stdout + done.stderr
    chatter = [w.message_start for w in KNOWN_WARNINGS if w.message_start in printed]
    if without_known_output(printed) != printed or "[Gloo]" in printed:
        chatter.append("[Gloo] ... connected")
    if chatter:
        raise RuntimeError(f"`{excerpt.command}` printed third-party chatter it should filter: {chatter[:3]}")
    return done.stdout


def failure_output(stderr: str, limit: int = 4000) -> str:
    """The end of a failed command's standard error and, where a rank crashed in native code,
    what it wrote first (glibc's message, faulthandler's "Fatal Python error" and every thread's
    stack), which comes long before the error its peer raises at the end."""
    crash = stderr.find("Fatal Python error")
    if crash < 0 or crash >= len(stderr) - limit:
        return stderr[-limit:]
    start = stderr.rfind("\n", 0, max(0, crash - 500)) + 1
    return f"{stderr[start : crash + limit]}\n...\n{stderr[-limit:]}"


def read_block(readme: str, name: str) -> str:
    """The text inside the fenced block between ``name``'s markers."""
    start, end = _markers(name)
    if readme.count(start) != 1 or readme.count(end) != 1:
        raise ValueError(f"the document must hold exactly one {start} and one {end}")
    inner = readme.split(start, 1)[1].split(end, 1)[0].strip("\n")
    lines = inner.splitlines()
    if len(lines) < 2 or not lines[0].startswith(FENCE) or lines[-1] != FENCE:
        raise ValueError(f"the text between {start} and {end} must be one fenced code block")
    return "\n".join(lines[1:-1]) + "\n"


def replace_block(readme: str, name: str, body: str) -> str:
    """``readme`` with the block between ``name``'s markers replaced by ``body``, fenced."""
    read_block(readme, name)  # validates the markers
    start, end = _markers(name)
    before, rest = readme.split(start, 1)
    after = rest.split(end, 1)[1]
    return f"{before}{start}\n{FENCE}text\n{body.rstrip(chr(10))}\n{FENCE}\n{end}{after}"


def masked(text: str, measured_prefix: str | None) -> str:
    """``text`` with every number on measured lines replaced by ``#``."""
    if measured_prefix is None:
        return text
    return "".join(
        _NUMBER.sub("#", line) if line.startswith(measured_prefix) else line for line in text.splitlines(keepends=True)
    )


def check(readme: str, excerpt: Excerpt, fresh: str) -> list[str]:
    """A unified diff between the document's block and ``fresh`` output (masked); empty if equal."""
    expected = masked(read_block(readme, excerpt.name), excerpt.measured_prefix)
    actual = masked(fresh, excerpt.measured_prefix)
    return list(
        difflib.unified_diff(
            expected.splitlines(), actual.splitlines(), f"{excerpt.document.name} {excerpt.name}", f"fresh `{excerpt.command}`", lineterm=""
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thunder_overlap.testing.readme_excerpts", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if an excerpt is stale")
    parser.add_argument("--only", choices=[e.name for e in EXCERPTS], action="append", help="render only these excerpts")
    args = parser.parse_args(argv)
    texts = {excerpt.document: excerpt.document.read_text() for excerpt in EXCERPTS}
    stale = False
    for excerpt in EXCERPTS:
        if args.only and excerpt.name not in args.only:
            continue
        print(f"running `{excerpt.command}` ...", file=sys.stderr, flush=True)
        fresh = render(excerpt)
        diff = check(texts[excerpt.document], excerpt, fresh)
        if args.check:
            stale |= bool(diff)
            print("\n".join(diff) if diff else f"{excerpt.name}: up to date")
        elif diff:
            texts[excerpt.document] = replace_block(texts[excerpt.document], excerpt.name, fresh)
    if not args.check:
        for document, text in texts.items():
            document.write_text(text)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
