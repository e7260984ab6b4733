"""The errors of ``checkpoint.save`` and ``checkpoint.load``.

Every one is an ``Exception`` (torch's ``CheckpointException`` is a ``BaseException``, which
``except Exception`` lets through) and a :class:`CheckpointError`. Where the cause was a
``FileNotFoundError``, ``KeyError`` or ``ValueError``, the error is one too, so ``except
FileNotFoundError`` around a first load keeps working; where torch's checkpoint code failed, it is
also a ``CheckpointException``, for code that caught that. Every rank of the group raises the same
class with the same message (see ``_agreement``).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointNotFoundError",
    "CheckpointValueError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "RankFailure",
    "distributed_checkpoint_error",
]


class CheckpointError(Exception):
    """A save or load that failed; every rank of the model's group raises it, naming the ranks
    that failed and why. ``causes`` maps each failing rank to its cause (``"Type: message"``)."""

    causes: dict[int, str]

    def __init__(self, message: str, causes: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.causes = dict(causes or {})

    def __str__(self) -> str:
        # KeyError would quote the message; the text is the same whatever the mixed-in type.
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the path."""


class CheckpointKeyError(CheckpointError, KeyError):
    """Keys that the model and the checkpoint do not share (with ``strict=True``)."""


class CheckpointValueError(CheckpointError, ValueError):
    """A value the checkpoint cannot hold or give, such as a tensor of another shape."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file whose size or CRC32 differs from what the manifest recorded at save."""


class DistributedCheckpointError(CheckpointError, CheckpointException):
    """``torch.distributed.checkpoint`` failed to write or read the files; ``failures`` is
    torch's own (rank -> exception and traceback), where this rank had them."""

    def __init__(self, message: str, causes: dict[int, str] | None = None, torch_failures: dict | None = None) -> None:
        super().__init__(message, causes)
        self._failures = dict(torch_failures or {})  # CheckpointException.failures


def distributed_checkpoint_error(what: str, error: CheckpointException) -> DistributedCheckpointError:
    """torch's ``CheckpointException`` (its text is a traceback per rank) as one line per rank."""
    causes = "; ".join(
        f"rank {rank}: {''.join(traceback.format_exception_only(type(exc), exc)).strip()}" for rank, (exc, _) in error.failures.items()
    )
    what = f" {what}" if what else ""
    return DistributedCheckpointError(f"torch.distributed.checkpoint failed{what}: {causes or error}", torch_failures=error.failures)


# Checked in order: the first class the cause is an instance of gives the error's class.
_CLASS_OF_CAUSE: tuple[tuple[type[BaseException], type[CheckpointError]], ...] = (
    (CorruptCheckpointError, CorruptCheckpointError),
    (CheckpointException, DistributedCheckpointError),
    (FileNotFoundError, CheckpointNotFoundError),
    (KeyError, CheckpointKeyError),
    (ValueError, CheckpointValueError),
)
ERROR_CLASSES: dict[str, type[CheckpointError]] = {c.__name__: c for _, c in _CLASS_OF_CAUSE} | {"CheckpointError": CheckpointError}


@dataclass(frozen=True)
class RankFailure:
    """What one rank sends the others about its failure: picklable, unlike many exceptions."""

    error_class: str  # a key of ERROR_CLASSES
    cause: str  # "Type: message"

    @classmethod
    def of(cls, error: BaseException) -> RankFailure:
        error_class = next((c for kind, c in _CLASS_OF_CAUSE if isinstance(error, kind)), CheckpointError)
        if isinstance(error, CheckpointException) and not isinstance(error, CheckpointError):
            error = distributed_checkpoint_error("", error)
        # str() of a KeyError quotes its message.
        text = str(error.args[0]) if isinstance(error, KeyError) and not isinstance(error, CheckpointError) and error.args else str(error)
        return cls(error_class.__name__, f"{type(error).__name__}: {text}")
