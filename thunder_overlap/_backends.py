"""What differs between communication backends, one object per backend.

The scheduler, the bucket runtime and the memory model ask a :class:`Backend` rather than test
backend names. Two facts set the bucket paths apart (see ``docs/design.md``, [Note: backends]):

- whether a coalesced launch of several collectives costs one launch (NCCL's group calls) or
  runs them one after another, each paying its latency (gloo): a bucket then gathers its flat
  shard rank-major and copies the parameters out, instead of gathering each into its place;
- whether a reduce-scatter copies its whole input at the launch and holds the copy until the
  wait (gloo), or reads the input while in flight (NCCL).

The fake process group, on which predictions trace, stands for NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the function that reads a group, so the command line's help needs none
    import torch
    import torch.distributed as dist

__all__ = ["FAKE", "GLOO", "NCCL", "Backend", "backend_of"]


@dataclass(frozen=True)
class Backend:
    """How one communication backend runs the collectives thunder_overlap issues."""

    name: str
    # A coalesced launch of several collectives costs about one launch.
    runs_coalesced_launch_as_one: bool
    # A reduce-scatter copies its whole input at the launch, in the calling thread, keeps no view
    # of it and holds the copy until the wait.
    copies_reduce_scatter_input: bool
    # Launches of one process group in progress at once (gloo's worker threads: one launch's
    # latency can pass while another transfers).
    concurrent_launches: int = 1

    @property
    def has_bucket_path_choices(self) -> bool:
        """Whether a bucket can trade a pool buffer for time on this backend (gather per
        parameter rather than copy out, reduce from the backend's copy rather than hold its
        lay-out): only where the default paths cost that buffer, i.e. not on NCCL."""
        return not self.runs_coalesced_launch_as_one or self.copies_reduce_scatter_input


NCCL = Backend("nccl", runs_coalesced_launch_as_one=True, copies_reduce_scatter_input=False)
# Two worker threads per process group (measured on the slow-link testbed, benchmarks/link_probe.py).
GLOO = Backend("gloo", runs_coalesced_launch_as_one=False, copies_reduce_scatter_input=True, concurrent_launches=2)
FAKE = Backend("fake", runs_coalesced_launch_as_one=True, copies_reduce_scatter_input=False)


def backend_of(group: dist.ProcessGroup, device: torch.device) -> Backend:
    """The backend that moves ``device``'s tensors on ``group``: NCCL for CUDA tensors on a group
    with NCCL, the fake group as NCCL, gloo otherwise (CPU tensors go through gloo whatever else
    the group has)."""
    name = _backend_name(group)
    if name == "fake":
        return FAKE
    if device.type == "cuda" and "nccl" in name:
        return NCCL
    return GLOO


def _backend_name(group: dist.ProcessGroup) -> str:
    """``dist.get_backend``'s name of ``group``'s backend. A group destroyed since (a trace whose
    memory is estimated after its fake group is gone) is no longer registered; the group object
    still names its backend, the fake group's as a custom one."""
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except ValueError:  # not in the world's group map any more
        name = group.name()
        return "fake" if name == "custom" else name
