"""run_local_ranks when a rank dies in native code: the error names the signal, not only the
"Connection reset by peer" its peer gets, and the dead rank's Python stack reaches stderr."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from thunder_overlap.testing.local_ranks import run_local_ranks

pytestmark = pytest.mark.ranks


def _rank_zero_segfaults(rank: int, world_size: int) -> None:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()  # rank 1 loses its peer here


def test_a_rank_killed_by_a_signal_is_named_with_its_stack(capfd):
    with pytest.raises(RuntimeError) as raised:
        run_local_ranks(_rank_zero_segfaults, 2, timeout_s=60)
    message = str(raised.value)
    # Whichever the parent sees first (rank 0's exit, or rank 1's failed barrier), rank 0's
    # death is what it reports.
    assert "rank 0: killed by SIGSEGV" in message or "ranks [0] exited: killed by SIGSEGV" in message
    stderr = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in stderr
    assert "_rank_zero_segfaults" in stderr
