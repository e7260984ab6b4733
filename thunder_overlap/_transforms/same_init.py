"""Ranks whose initial weights differ: refused at ``fsdp()``, naming the first parameter.

FSDP keeps one copy of each row, on the rank that shards it: if the ranks built the model under
different seeds, the sharded model silently holds rows of several initialisations. Before Thunder's
FSDP shards the model, every rank fingerprints each parameter (with its shape and dtype: ranks
that built different models are told so) and the ranks compare them in one object all-gather. A
fingerprint is the sum of the elements' bit patterns as 64-bit integers: exact and independent of
the summation's order (a float sum would differ in its last bits between machines that split the
reduction differently), so equal weights always agree. Parameters on the meta device are
initialised later, from the random generator of the device they materialise on; for them that
generator's state is compared. Skipped with ``broadcast_from``, which makes the weights equal, and
where there is nobody to compare with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from thunder.core.transform_common import Transform

from thunder_overlap._scheduling.rank_agreement import exchange_is_possible, first_differing_value

__all__ = ["RefuseDifferentInitTransform"]

# The integer dtype whose bit patterns each element size sums as.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GENERATOR = "the random generator's state (parameters on the meta device are initialised from it)"


def _fingerprint(tensor: torch.Tensor) -> int:
    """The sum of ``tensor``'s elements' bit patterns, as a 64-bit integer (wrapping around)."""
    tensor = tensor.detach()
    if tensor.element_size() not in _BITS:  # complex: its bytes
        tensor = tensor.contiguous().view(torch.int8)
    return int(tensor.view(_BITS[tensor.element_size()]).sum(dtype=torch.int64))


def _generator_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


class RefuseDifferentInitTransform(Transform):
    """Raises ValueError on every rank of ``group`` when the ranks' parameters differ before
    sharding, naming the first that differs, the ranks, and ``broadcast_from=0``."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group, self.device = group, device

    def transform_module(self, model) -> None:
        if not exchange_is_possible(self.group):
            return
        parameters = dict(model.named_parameters())
        values: dict[str, tuple] = {
            name: (tuple(p.shape), str(p.dtype), None if p.is_meta else _fingerprint(p)) for name, p in parameters.items()
        }
        if any(p.is_meta for p in parameters.values()):
            values[_GENERATOR] = ((), "", _fingerprint(_generator_state(self.device)))
        difference = first_differing_value(values, self.group)
        if difference is None:
            return
        name, ranks = difference.key, difference.ranks
        reference, theirs = difference.values[0], difference.values[ranks[0]]
        if name != _GENERATOR and (reference is None or theirs is None or reference[:2] != theirs[:2]):
            shown = [f"rank {rank}: {'none' if v is None else f'{list(v[0])} {v[1]}'}" for rank, v in enumerate(difference.values)]
            raise ValueError(
                f"thunder_overlap.fsdp: the ranks built different models: parameter {name!r} ({', '.join(shown)}); "
                "every rank must shard the same model"
            )
        what = _GENERATOR if name == _GENERATOR else f"parameter {name!r}"
        raise ValueError(
            f"thunder_overlap.fsdp: ranks {ranks} differ from rank 0 in {what} before sharding, so the sharded model would "
            "mix rows of different initialisations. Seed every rank alike before building the model (torch.manual_seed), "
            "or pass broadcast_from=0 to start every rank from rank 0's weights"
        )
