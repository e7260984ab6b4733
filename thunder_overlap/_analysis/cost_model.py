"""How long each bound symbol and each collective takes: a roofline and a ring alpha-beta model.

Compute: ``max(flops / (peak_flops * efficiency), bytes / (bandwidth * efficiency)) + launch``,
where FLOPs are counted for matmul-like ops (the ones that matter) and every other op costs one
FLOP per output element; bytes are the op's tensor inputs and outputs, and zero for views, whose
outputs alias their input. Calibration replaces the roofline with the time measured on the real
device for each distinct op shape (:class:`Calibration`), and a user hook can override both.

Collectives: an all-gather or reduce-scatter on ``n`` ranks takes
``latency * steps(n) + (n - 1) / n * unsharded_bytes / bus_bandwidth`` (an all-reduce twice that),
the model NCCL's own performance notes and nccl-tests' "bus bandwidth" use. ``steps(n)`` is the
network's algorithm: ``n - 1`` for a ring, ``ceil(log2 n)`` for a tree (NCCL's PAT). ``n`` is the
size of the collective's process group, read from the trace. Every launch pays the latency: a
collective of the trace is one launch, and a coalesced launch of several tensors is one collective
of the trace (see ``classify``), so collectives issued back to back never share it. A bucket that gathers
each parameter in place where the backend runs a coalesced launch one collective at a time pays
it once per parameter (``Collective.launches``); only the first latency can pass while another
launch transfers, the others are counted as time on the link (on the slow-link testbed, such
small launches queued behind the other launch's transfers: collectives run per tensor were 8.8%
slower where hiding their latencies predicted under 1%). Each
collective runs on the network of its process group: one network for all, or with a
:class:`~thunder_overlap._analysis.network.NodeTopology` the intra-node network for a group inside
one node and the inter-node one for a group across nodes (hybrid sharding's two groups). Where the
backend runs several launches of a group at once (``NetworkProfile.concurrent_launches``: gloo's
worker threads), one launch's latency can pass while another moves bytes; the link still carries
one transfer at a time (see ``simulator``).

Local copies: a bucketed collective's start and wait copy the bucket in local memory (lay-out,
pre-average, copy-out); :meth:`CostModel.local_copy_ms` costs the bytes that
:mod:`~thunder_overlap._analysis.local_copies` counts at memory bandwidth, and the simulator runs
them on the compute stream at the launch and at the wait.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from thunder.core import dtypes
from thunder.core.proxies import FutureTensorProxy, TensorProxy
from thunder.core.symbol import BoundSymbol

from thunder_overlap import _ops as ops
from thunder_overlap._analysis.calibration import METADATA_OPS, Calibration
from thunder_overlap._analysis.classify import AnnotatedTrace, Collective, CollectiveKind
from thunder_overlap._analysis.devices import DEVICE_PROFILES, FALLBACK_GPU_PROFILE, DeviceProfile, device_profile, gpu_profile_of
from thunder_overlap._analysis.layout import NO_BUCKETS, BucketLayouts
from thunder_overlap._analysis.local_copies import local_copy_bytes
from thunder_overlap._analysis.network import (
    LATENCY_ALGORITHMS,
    NETWORK_PROFILES,
    NetworkProfile,
    NodeTopology,
    default_network,
    gpus_per_node,
    network_profile,
)

__all__ = [
    "DEVICE_PROFILES",
    "NETWORK_PROFILES",
    "Calibration",
    "CostModel",
    "DeviceProfile",
    "LATENCY_ALGORITHMS",
    "NetworkProfile",
    "NodeTopology",
    "default_cost_model",
    "default_network",
    "device_profile",
    "network_profile",
    "op_bytes",
    "op_flops",
]


# ---------------------------------------------------------------------------------------------
# Counting

# Attention: two matmuls of (q @ k^T) and (p @ v); its backward does five, 2.5x the forward.
_ATTENTION_BACKWARD_FACTOR = 2.5


def _tensors(values) -> list[TensorProxy]:
    return [v for v in values if isinstance(v, TensorProxy) and not isinstance(v, FutureTensorProxy)]




def _matmul_flops(bsym: BoundSymbol) -> int | None:
    name = ops.compute_name(bsym)
    ins, outs = _tensors(bsym.flat_args), _tensors(bsym.flat_outs)
    if not ins or not outs:
        return None
    if name in ("matmul", "mm", "bmm", "addmm", "baddbmm") and len(ins) >= 2:
        inner = int(ins[0].shape[-1]) if ins[0].ndim else 1
        return 2 * ops.numel(outs[0]) * inner
    if name == "linear" and len(ins) >= 2:
        return 2 * ops.numel(outs[0]) * int(ins[0].shape[-1]) + (ops.numel(outs[0]) if len(ins) > 2 else 0)
    if "scaled_dot_product" in name or name.startswith("sdpa"):
        q, k = ins[0], ins[1]
        batch_heads = math.prod(int(s) for s in q.shape[:-2])
        forward = 4 * batch_heads * int(q.shape[-2]) * int(k.shape[-2]) * int(q.shape[-1])
        return int(forward * (_ATTENTION_BACKWARD_FACTOR if "backward" in name or "bwd" in name else 1))
    return None


def op_flops(bsym: BoundSymbol) -> int:
    """FLOPs of a top-level bound symbol: matmul-like ops exactly, fusions as the sum of their
    parts, anything else one per output element."""
    flops = _matmul_flops(bsym)
    if flops is not None:
        return flops
    if bsym.sym.name in METADATA_OPS:
        return 0
    if bsym.subsymbols and bsym.sym.is_fusion:
        return sum(op_flops(s) for s in bsym.subsymbols)
    return sum(ops.numel(t) for t in _tensors(bsym.flat_outs))


def op_bytes(bsym: BoundSymbol) -> int:
    """Bytes read and written: tensor inputs and outputs (a fusion's intermediates stay on chip)."""
    if bsym.sym.name in METADATA_OPS:
        return 0
    return sum(ops.numel(t) * t.dtype.bytes for t in _tensors([*bsym.flat_args, *bsym.flat_outs]))


# ---------------------------------------------------------------------------------------------
# The model

# A user estimate: milliseconds for a bound symbol, or None to fall back to the model.
UserEstimate = Callable[[BoundSymbol], "float | None"]


@dataclass
class CostModel:
    """Milliseconds per compute op and per collective.

    Precedence for compute: ``user_estimate`` (when it returns a number), then ``calibration``
    (measured, when it has the op's shape), then the roofline of ``device``.

    Collectives: ``collective_estimate`` (when it returns a number), else the ring model on the
    network of the collective's process group (:meth:`network_for`): ``topology``'s choice for
    the group when there is a topology, else ``network``. ``network`` is also what the
    rank-count-only methods (``latency_ms``, ``transfer_ms``, ``unhidden_latency_ms``) use unless
    given another: give it the network of the group parameters are sharded over.
    """

    device: DeviceProfile
    network: NetworkProfile
    calibration: Calibration | None = None
    user_estimate: UserEstimate | None = None
    # Milliseconds for a collective, or None to fall back to the network model.
    collective_estimate: Callable[[Collective], float | None] | None = None
    # How much slower compute runs while a collective is in flight (0.2: 20% slower). Overlap is
    # not free: NCCL's kernels take SMs from the compute beside them, and on a CPU the
    # communication threads take cores. 0 assumes free overlap; calibrate it by running compute
    # and communication at once (benchmarks/slow_link.py does).
    overlap_compute_slowdown: float = 0.0
    # Where ranks sit, so that each process group gets its own network (hybrid sharding: the
    # shard group inside a node, the replicate group across nodes); None: ``network`` for all.
    topology: NodeTopology | None = None

    def __post_init__(self) -> None:
        if not self.overlap_compute_slowdown >= 0:
            raise ValueError(f"overlap_compute_slowdown must be >= 0 (0: overlap is free), got {self.overlap_compute_slowdown!r}")

    @classmethod
    def named(cls, device: str | DeviceProfile = "h100", network: str | NetworkProfile = "nvlink", **kwargs) -> CostModel:
        return cls(device_profile(device), network_profile(network), **kwargs)

    @classmethod
    def for_device(cls, device: torch.device | str, world_size: int) -> CostModel:
        """The scheduler's default: the profile of ``device`` (an H100 for an unknown GPU), over
        :func:`default_network` with ``LOCAL_WORLD_SIZE`` GPUs per node (default 8), and each
        process group over NVLink inside a node and InfiniBand across nodes (a
        :class:`NodeTopology`); a CPU over loopback gloo for every group."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls.named("cpu", "gloo-loopback")
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else ""
        profile = gpu_profile_of(name) or FALLBACK_GPU_PROFILE
        per_node = gpus_per_node()
        topology = NodeTopology("nvlink", "infiniband", per_node)
        return cls.named(profile, default_network(world_size, per_node), topology=topology)

    def network_for(self, collective: Collective) -> NetworkProfile:
        """The network ``collective`` runs on: its group's under ``topology``, else ``network``
        (also for a collective of no known group)."""
        return self.network_of_group(collective.process_group)

    def network_of_group(self, group: dist.ProcessGroup | None) -> NetworkProfile:
        """The network ``group`` talks over: its own under ``topology``, else ``network``."""
        if self.topology is None or group is None:
            return self.network
        return self.topology.network_of(group)

    @property
    def is_measured(self) -> bool:
        """True when estimates may differ between ranks (measured, or from a user hook)."""
        return self.calibration is not None or self.user_estimate is not None or self.collective_estimate is not None

    def compute_ms(self, bsym: BoundSymbol) -> float:
        if self.user_estimate is not None:
            estimate = self.user_estimate(bsym)
            if estimate is not None:
                return float(estimate)
        if bsym.sym.name in METADATA_OPS:
            return 0.0
        if self.calibration is not None:
            measured = self.calibration.lookup(bsym)
            if measured is not None:
                return measured
        if bsym.sym.id == ops.bucket_accumulate_grads.id:  # a bucket operator that only copies (no_sync)
            return self.copy_ms(local_copy_bytes(bsym, NO_BUCKETS))
        return self.roofline_ms(bsym)

    def local_copy_ms(self, bsym: BoundSymbol, layouts: BucketLayouts, issued_by: BoundSymbol | None = None) -> float:
        """Time of the local copies a bucketed collective's start or wait makes, on the compute
        stream: their bytes (read + written) at the device's memory bandwidth x efficiency. A
        wait's ``issued_by`` is its collective's issue (see ``local_copies.WAIT_COPY_BYTES``)."""
        return self.copy_ms(local_copy_bytes(bsym, layouts, issued_by))

    def copy_ms(self, moved_bytes: int) -> float:
        """A memory-bound copy that reads and writes ``moved_bytes`` in all."""
        d = self.device
        return moved_bytes / (d.memory_bandwidth * d.bandwidth_efficiency) * 1e3

    def roofline_ms(self, bsym: BoundSymbol) -> float:
        d = self.device
        # Tensor cores run 16-bit inputs; any 32-bit float input runs at the FP32 rate.
        wide = any(dtypes.is_float_dtype(t.dtype) and t.dtype.bytes >= 4 for t in _tensors(bsym.flat_args))
        peak = d.matmul_flops_32bit if wide else d.matmul_flops_16bit
        flops_s = op_flops(bsym) / (peak * d.flops_efficiency)
        bytes_s = op_bytes(bsym) / (d.memory_bandwidth * d.bandwidth_efficiency)
        return (max(flops_s, bytes_s) + d.launch_overhead_s) * 1e3

    def collective_ms(self, collective: Collective, world_size: int | None = None) -> float:
        """Time of ``collective`` over its process group (or ``world_size`` ranks): its
        latency, once per launch the backend makes of it, plus its transfer."""
        if self.collective_estimate is not None:
            estimate = self.collective_estimate(collective)
            if estimate is not None:
                return float(estimate)
        n = world_size if world_size is not None else _group_size(collective)
        network = self.network_for(collective)
        latency = collective.launches * self.latency_ms(n, network)
        return _phases(collective) * (latency + self.transfer_ms(collective.unsharded_bytes, n, network))

    def collective_latency_ms(self, collective: Collective, world_size: int | None = None) -> float:
        """The part of :meth:`collective_ms` that is latency, not time on the link: with
        concurrent launches it passes while another launch of the group transfers. One launch's
        worth: the latencies of a collective's further launches hold the link. A measured
        estimate for a collective of no known group size counts as all transfer."""
        total = self.collective_ms(collective, world_size)
        if world_size is None and collective.process_group is None:
            return 0.0
        n = world_size if world_size is not None else _group_size(collective)
        return min(_phases(collective) * self.latency_ms(n, self.network_for(collective)), total)

    def latency_ms(self, ranks: int, network: NetworkProfile | None = None) -> float:
        """What one all-gather or reduce-scatter launch on ``ranks`` ranks pays however small,
        on ``network`` (default: ``self.network``)."""
        network = network or self.network
        return network.latency_steps(ranks) * network.latency_s * 1e3

    def unhidden_latency_ms(self, unsharded_bytes: int, ranks: int, network: NetworkProfile | None = None) -> float:
        """The latency one all-gather or reduce-scatter adds to a run of launches like it: all of
        it with one launch at a time; with concurrent launches, what outlasts the transfer of the
        launch before it (latencies pass one at a time, as the simulator runs them)."""
        network = network or self.network
        if network.concurrent_launches == 1:
            return self.latency_ms(ranks, network)
        return max(0.0, self.latency_ms(ranks, network) - self.transfer_ms(unsharded_bytes, ranks, network))

    def transfer_ms(self, unsharded_bytes: int, ranks: int, network: NetworkProfile | None = None) -> float:
        """Bandwidth time of an all-gather or reduce-scatter of ``unsharded_bytes`` on ``ranks``
        ranks, on ``network`` (default: ``self.network``)."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) / ranks * unsharded_bytes / (network or self.network).bus_bandwidth * 1e3


def _phases(collective: Collective) -> int:
    """Ring passes of one launch: an all-reduce is a reduce-scatter and an all-gather."""
    return 2 if collective.kind is CollectiveKind.ALL_REDUCE else 1


def _group_size(collective: Collective) -> int:
    group = collective.process_group
    if group is None:
        raise ValueError("the collective has no process group in the trace; pass world_size= to collective_ms")
    return group.size()


def default_cost_model(annotated: AnnotatedTrace) -> CostModel:
    """The device profile of the trace's collectives (``CostModel.for_device``: a CPU trace gets
    ``cpu`` over ``gloo-loopback``) at the size of their process group."""
    for coll in annotated.collectives:
        tensors = [a for a in annotated.nodes[coll.start].bsym.flat_args if isinstance(a, TensorProxy)]
        if tensors:
            world_size = coll.process_group.size() if coll.process_group is not None else 1
            return CostModel.for_device(tensors[0].device.device_str(), world_size)
    return CostModel.named("cpu", "gloo-loopback")  # no tensor collective: nothing is judged with it
