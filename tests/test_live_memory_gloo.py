"""LiveMemoryTracker on two gloo ranks: the copy gloo's reduce-scatter makes of its input, which
no dispatch mode sees, is counted from the launch until the wait, or, as NCCL would hold it, the
input itself (one spawn for every case)."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.ranks


NUMEL = 1 << 16
INPUT_BYTES = NUMEL * 4  # a reduce-scatter's input; its output on 2 ranks is half of it


def _measure(rank: int, world_size: int) -> dict[str, list[int]]:
    """Bytes the tracker counts once a collective is launched and its input deleted, then once it
    is waited on and its work released."""
    import torch.distributed as dist

    from thunder_overlap.testing.live_memory import LiveMemoryTracker

    def settled(tracker: LiveMemoryTracker, floor: int) -> int:
        # gloo's worker thread lets go of a finished work (and the copy the wait touched, which
        # the tracker then follows as a storage) a moment after the wait returns.
        deadline = time.monotonic() + 1.0
        while tracker.current_bytes > floor and time.monotonic() < deadline:
            time.sleep(0.001)
        return tracker.current_bytes

    seen: dict[str, list[int]] = {}
    for mode in LiveMemoryTracker.COLLECTIVE_BUFFERS:
        with LiveMemoryTracker(collective_buffers=mode) as tracker:
            out, grads = torch.empty(NUMEL // world_size), torch.ones(NUMEL)
            work = dist.reduce_scatter_tensor(out, grads, async_op=True)
            del grads
            launched = tracker.current_bytes
            work.wait()
            del work
            seen[f"alone, {mode}"] = [launched, settled(tracker, out.nbytes)]
            # The input kept by the caller, as a bucket that sends its gradients where they are.
            grads = torch.ones(NUMEL)
            work = dist.reduce_scatter_tensor(out, grads, async_op=True)
            launched = tracker.current_bytes
            work.wait()
            del work, grads
            seen[f"kept, {mode}"] = [launched, settled(tracker, out.nbytes)]

    with LiveMemoryTracker() as tracker:
        out, grads = torch.empty(NUMEL // world_size), [torch.ones(NUMEL // 2), torch.ones(NUMEL // 2)]
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.reduce_scatter_tensor(out[: NUMEL // 4], grads[0])
            dist.reduce_scatter_tensor(out[NUMEL // 4 :], grads[1])
        del grads
        launched = tracker.current_bytes
        manager.wait()
        del manager
        seen["coalesced"] = [launched, settled(tracker, out.nbytes)]

    with LiveMemoryTracker() as tracker:
        gathered, shard = torch.empty(NUMEL * world_size), torch.ones(NUMEL)
        work = dist.all_gather_into_tensor(gathered, shard, async_op=True)
        launched = tracker.current_bytes
        work.wait()
        del work
        seen["all-gather"] = [launched, tracker.current_bytes]
    return seen


def test_gloo_reduce_scatter_copies_are_counted_until_the_wait(local_ranks):
    seen = local_ranks(_measure, 2, ())[0]
    output_bytes = INPUT_BYTES // 2
    # The input is freed at once (gloo does not hold it); gloo's copy of it is counted until the wait.
    assert seen["alone, as_run"] == [output_bytes + INPUT_BYTES, output_bytes]
    # As NCCL would: the input itself is held until the wait, then freed; no copy after it.
    assert seen["alone, as_nccl"] == [output_bytes + INPUT_BYTES, output_bytes]
    # What a dispatch mode sees on its own: nothing in flight.
    assert seen["alone, seen"] == [output_bytes, output_bytes]
    # An input the caller keeps: gloo holds a copy beside it, NCCL only the input.
    assert seen["kept, as_run"] == [output_bytes + 2 * INPUT_BYTES, output_bytes]
    assert seen["kept, as_nccl"] == [output_bytes + INPUT_BYTES, output_bytes]
    assert seen["kept, seen"] == [output_bytes + INPUT_BYTES, output_bytes]
    assert seen["coalesced"] == [output_bytes + INPUT_BYTES, output_bytes]
    # An all-gather copies nothing: its output and input are all there is.
    assert seen["all-gather"] == [3 * INPUT_BYTES, 3 * INPUT_BYTES]
