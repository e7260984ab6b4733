"""README.md's excerpts match fresh runs of their commands, and the commands print no
third-party chatter.

The demo excerpt runs the whole demo once (about a minute on an idle 2-core machine: 2 gloo
ranks compile and train, then 4 meta-device traces predict 8 and 64 GPUs); every line must match
except the numbers on ``measured:`` lines.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from thunder_overlap._console import filter_known_output, without_known_output
from thunder_overlap.testing import readme_excerpts
from thunder_overlap.testing.demo import MEASURED_PREFIX
from thunder_overlap.testing.readme_excerpts import EXCERPTS, Excerpt, check, masked, read_block, replace_block

EXCERPT_BY_NAME = {e.name: e for e in EXCERPTS}
GLOO_LINE = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def _readme() -> str:
    return readme_excerpts.README.read_text()


@pytest.mark.parametrize("name", sorted(EXCERPT_BY_NAME))
def test_readme_excerpt_matches_a_fresh_run(name):
    excerpt = EXCERPT_BY_NAME[name]
    fresh = readme_excerpts.render(excerpt)  # raises on a failure or third-party chatter
    diff = check(_readme(), excerpt, fresh)
    assert not diff, "README.md is stale; run python -m thunder_overlap.testing.readme_excerpts\n" + "\n".join(diff)


def test_masking_lets_only_measured_numbers_differ():
    excerpt = Excerpt("x", ("demo",), MEASURED_PREFIX)
    readme = f"intro\n<!-- x:start -->\n```text\npeak 1.30 MiB\n{MEASURED_PREFIX} thunder 12.5 ms\n```\n<!-- x:end -->\n"
    assert check(readme, excerpt, f"peak 1.30 MiB\n{MEASURED_PREFIX} thunder 9871.0 ms\n") == []
    assert check(readme, excerpt, f"peak 1.31 MiB\n{MEASURED_PREFIX} thunder 12.5 ms\n") != []
    # Words on a measured line still count.
    assert check(readme, excerpt, f"peak 1.30 MiB\n{MEASURED_PREFIX} thunder_overlap 12.5 ms\n") != []
    assert masked("a 1.5\n", None) == "a 1.5\n"


def test_replace_block_round_trips_and_rejects_bad_markers():
    readme = "before\n<!-- x:start -->\n```text\nold\n```\n<!-- x:end -->\nafter\n"
    updated = replace_block(readme, "x", "new line\n")
    assert read_block(updated, "x") == "new line\n"
    assert updated.startswith("before\n") and updated.endswith("after\n")
    with pytest.raises(ValueError, match="exactly one"):
        read_block("no markers here", "x")
    with pytest.raises(ValueError, match="one fenced code block"):
        read_block("<!-- x:start -->\nloose text\n<!-- x:end -->", "x")


def test_known_output_is_dropped_even_interleaved_and_everything_else_kept(capfd):
    # A child process writes straight to the inherited descriptor, as gloo's native code does,
    # one message split around another as two ranks' pieces arrive.
    child = (
        "import os; g = os.environ['GLOO_LINE'].encode(); "
        "os.write(1, b'before\\n' + g[:13] + g + b'\\n' + g[13:] + b'\\nerror: a real problem\\n')"
    )
    with filter_known_output():
        subprocess.run([sys.executable, "-c", child], check=True, env={**os.environ, "GLOO_LINE": GLOO_LINE})
        os.write(1, b"parent line\n")
    out = capfd.readouterr().out
    assert out.splitlines() == ["before", "error: a real problem", "parent line"]


def test_unknown_text_next_to_known_output_is_kept():
    assert without_known_output(f"x{GLOO_LINE}\ny\n") == "xy\n"
    assert without_known_output("[Gloo] Rank 0 is connected to 0 peers\n") == "[Gloo] Rank 0 is connected to 0 peers\n"
