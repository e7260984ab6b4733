"""Sharded checkpoints on ``torch.distributed.checkpoint``, readable at any world size.

    from thunder_overlap import checkpoint
    checkpoint.save("ckpt/step-1000", model, optimizer, extra_state={"step": 1000})  # every rank
    step = checkpoint.load("ckpt/step-1000", model, optimizer).extra_state["step"]  # any world size, sharding, bucketing
    checkpoint.save("model.pth", model, full=True)  # one file, the original names and shapes, written by rank 0

``get_state_dict`` / ``set_state_dict`` mirror ``torch.distributed.checkpoint.state_dict``: the
state in the parameters' original shapes (DTensors sharded on dim 0, or full tensors with
``StateDictOptions(full_state_dict=True)``) and the optimizer's state keyed by parameter name.
``layout`` says how Thunder's padded shards map onto DTensors.

``save`` records every file's size and CRC32 in a manifest and ``load`` verifies them. Each runs
in phases that every rank passes together: a failure on any rank raises the same
:class:`CheckpointError` (an ``Exception``) on every rank, naming the rank and the cause.
"""

from thunder_overlap.checkpoint._errors import (
    CheckpointError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CorruptCheckpointError,
    DistributedCheckpointError,
)
from thunder_overlap.checkpoint._files import load, save
from thunder_overlap.checkpoint._state_dict import LoadResult, StateDictOptions, get_state_dict, set_state_dict

__all__ = [
    "CheckpointError", "CheckpointKeyError", "CheckpointNotFoundError", "CheckpointValueError", "CorruptCheckpointError",
    "DistributedCheckpointError", "LoadResult", "StateDictOptions", "get_state_dict", "load", "save", "set_state_dict",
]  # fmt: skip
