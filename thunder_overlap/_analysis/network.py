"""Networks: how a link between ranks is modelled, which one a process group uses.

A :class:`NetworkProfile` is one link's per-step latency, bus bandwidth, algorithm and concurrent
launches (the cost model's ring alpha-beta model reads it; see ``cost_model``). A
:class:`NodeTopology` says which network each process group talks over: ranks sit on nodes in
consecutive blocks of ``gpus_per_node`` (rank ``r`` on node ``r // gpus_per_node``, as torchrun
numbers them), and a group whose ranks all lie in one node uses the intra-node network (NVLink by
default), any other the inter-node one (InfiniBand). Under hybrid sharding on a (replicate,
shard) mesh whose shard group fits a node, that puts the all-gathers and reduce-scatters on NVLink
and the all-reduces across replicas on InfiniBand; plain FSDP's one group gets what
:func:`default_network` gives its size.

A group's ranks are read with ``torch.distributed.get_process_group_ranks`` the first time the
topology meets it and remembered for as long as the group object lives, so a group destroyed
after that (the report's fake groups) keeps its network; one never met while alive cannot be
placed and raises.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a group is read: the CLI checks networks without it
    import torch.distributed as dist

from thunder_overlap._backends import GLOO

__all__ = [
    "DEFAULT_GPUS_PER_NODE",
    "LATENCY_ALGORITHMS",
    "NETWORK_PROFILES",
    "NetworkProfile",
    "NodeTopology",
    "default_network",
    "gpus_per_node",
    "network_profile",
]

# How many latencies one all-gather or reduce-scatter launch pays on n ranks, per algorithm.
LATENCY_ALGORITHMS = ("ring", "tree")


@dataclass(frozen=True)
class NetworkProfile:
    """Per-step latency, bus bandwidth (nccl-tests' ``busbw``), the algorithm whose step
    count multiplies the latency (``"ring"`` pays ``n - 1`` steps, ``"tree"`` ``ceil(log2 n)``)
    and how many launches of one process group run at once."""

    name: str
    latency_s: float
    bus_bandwidth: float  # bytes/s
    algorithm: str = "ring"
    # Launches of one group in progress at once, sharing its link: NCCL runs a communicator's
    # collectives one after another on its stream (1); gloo runs them on a pool of worker
    # threads (two by default), so one launch's latency passes while another one transfers.
    concurrent_launches: int = 1

    def __post_init__(self) -> None:
        if self.algorithm not in LATENCY_ALGORITHMS:
            raise ValueError(f"NetworkProfile.algorithm must be one of {LATENCY_ALGORITHMS}, got {self.algorithm!r}")
        if isinstance(self.concurrent_launches, bool) or not isinstance(self.concurrent_launches, int) or self.concurrent_launches < 1:
            raise ValueError(f"NetworkProfile.concurrent_launches must be an integer >= 1, got {self.concurrent_launches!r}")
        if not self.latency_s >= 0 or not self.bus_bandwidth > 0:
            raise ValueError(
                f"NetworkProfile {self.name!r} needs latency_s >= 0 and bus_bandwidth > 0, "
                f"got {self.latency_s!r} and {self.bus_bandwidth!r}"
            )

    def latency_steps(self, ranks: int) -> int:
        """Latencies one launch pays on ``ranks`` ranks."""
        if ranks <= 1:
            return 0
        return ranks - 1 if self.algorithm == "ring" else math.ceil(math.log2(ranks))


# NVLink 4 (H100/H200 DGX, NVSwitch): 450 GB/s per direction per GPU; nccl-tests report about
# 360 GB/s bus bandwidth for all-gather at large sizes, and a few microseconds per ring step.
# InfiniBand NDR (one 400 Gb/s = 50 GB/s NIC per GPU): about 45 GB/s bus bandwidth across nodes,
# with ~10 us per step (network hops plus proxy thread). Loopback gloo on a CPU: about 1 GB/s.
# Algorithms: NCCL runs all-gather and reduce-scatter as rings (its tree algorithm is for
# all-reduce), so the ring's n - 1 steps is what "nvlink" and "infiniband" pay: at 1024 ranks that
# makes every launch cost ~10 ms of latency, which is why buckets must grow with the world size.
# NCCL >= 2.23's PAT algorithm runs them in log2(n) steps, but only with one GPU per node:
# "infiniband-pat" models that. gloo's algorithms are rings too, run by ProcessGroupGloo's two
# worker threads: two launches in progress at once (on a rate-limited link two in flight move as
# many bytes per second as one large one, while one at a time leaves it idle between launches).
NETWORK_PROFILES: dict[str, NetworkProfile] = {
    "nvlink": NetworkProfile("nvlink", 3e-6, 360e9),
    "infiniband": NetworkProfile("infiniband", 10e-6, 45e9),
    "infiniband-pat": NetworkProfile("infiniband-pat", 10e-6, 45e9, algorithm="tree"),
    "gloo-loopback": NetworkProfile("gloo-loopback", 50e-6, 1e9, concurrent_launches=GLOO.concurrent_launches),
}


# GPUs one NVLink domain joins when nothing says otherwise: an 8-GPU H100/A100 node (DGX/HGX).
DEFAULT_GPUS_PER_NODE = 8


def gpus_per_node() -> int:
    """GPUs per node on this machine: ``LOCAL_WORLD_SIZE`` (the ranks torchrun starts on each
    node), else :data:`DEFAULT_GPUS_PER_NODE`. For the scheduler's default cost model and the
    report's choice of network alike."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", DEFAULT_GPUS_PER_NODE))


def default_network(world_size: int, gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> str:
    """The network a GPU group of ``world_size`` is assumed to use: NVLink while it fits one
    node, InfiniBand beyond. The one place that default is decided (scheduler and report CLI);
    :class:`NodeTopology` gives the same answer for a group of ranks ``0 .. world_size - 1``."""
    return "nvlink" if world_size <= gpus_per_node else "infiniband"


def network_profile(name: str | NetworkProfile) -> NetworkProfile:
    """A named profile, or ``"custom:<latency_us>:<bus GB/s>[:ring|tree[:<concurrent launches>]]"``
    (e.g. ``custom:5:100``: a ring, one launch at a time, unless named; ``custom:1000:0.05:ring:2``
    is a gloo link)."""
    if isinstance(name, NetworkProfile):
        return name
    if name in NETWORK_PROFILES:
        return NETWORK_PROFILES[name]
    if name.startswith("custom:"):
        fields = name.split(":")[1:]
        try:
            latency, bandwidth = float(fields[0]) * 1e-6, float(fields[1]) * 1e9
            algorithm = fields[2] if len(fields) >= 3 else "ring"
            concurrent = int(fields[3]) if len(fields) == 4 else 1
        except (ValueError, IndexError):
            latency = bandwidth = -1.0
            concurrent = 0
        if 2 <= len(fields) <= 4 and latency >= 0 and bandwidth > 0 and algorithm in LATENCY_ALGORITHMS and concurrent >= 1:
            return NetworkProfile(name, latency, bandwidth, algorithm, concurrent)
    raise ValueError(
        f"unknown network {name!r}; accepted: {sorted(NETWORK_PROFILES)} or "
        "'custom:<latency_us>:<bus_GBps>[:ring|tree[:<concurrent launches>]]' with latency >= 0, bandwidth > 0 "
        "and concurrent launches >= 1"
    )


@dataclass(frozen=True)
class NodeTopology:
    """Which network each process group uses: ``intra_node`` when all its ranks lie in one node
    of ``gpus_per_node`` consecutive ranks, ``inter_node`` otherwise. Names or profiles are
    accepted for the two networks (``NodeTopology("nvlink", "infiniband")``)."""

    intra_node: NetworkProfile
    inter_node: NetworkProfile
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    # group -> its ranks, read while it was alive (see the module docstring).
    _ranks: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "intra_node", network_profile(self.intra_node))
        object.__setattr__(self, "inter_node", network_profile(self.inter_node))
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"NodeTopology.gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")

    def nodes_of(self, ranks: Iterable[int]) -> int:
        """How many nodes ``ranks`` touch."""
        return len({r // self.gpus_per_node for r in ranks})

    def network_of_ranks(self, ranks: Iterable[int]) -> NetworkProfile:
        """The network a group of ``ranks`` talks over."""
        return self.intra_node if self.nodes_of(ranks) <= 1 else self.inter_node

    def group_ranks(self, group: dist.ProcessGroup) -> tuple[int, ...]:
        """The global ranks of ``group``, remembered from the first time it was seen alive."""
        ranks = self._ranks.get(group)
        if ranks is None:
            import torch.distributed as dist

            try:
                ranks = tuple(dist.get_process_group_ranks(group))
            except (KeyError, RuntimeError, ValueError) as e:
                raise ValueError(
                    f"cannot place a process group of {group.size()} ranks on nodes: its ranks are unknown "
                    f"({type(e).__name__}: the group was destroyed, or never initialised, before this topology met it); "
                    "simulate while the group is alive, or use a CostModel without a topology (one network for every group)"
                ) from None
            self._ranks[group] = ranks
        return ranks

    def network_of(self, group: dist.ProcessGroup) -> NetworkProfile:
        """The network ``group`` talks over."""
        return self.network_of_ranks(self.group_ranks(group))

    def placement(self, group: dist.ProcessGroup) -> str:
        """Where ``group``'s ranks lie, for reports: ``"in 1 node"`` or ``"across 128 nodes"``."""
        nodes = self.nodes_of(self.group_ranks(group))
        return "in 1 node" if nodes <= 1 else f"across {nodes} nodes"
