"""Phases of a save or load that every rank passes together, or none does.

A step that can fail on one rank (rank 0 creating the staging directory, a file missing on one
rank's view of the storage, a shape mismatch) would otherwise leave the other ranks waiting in the
next collective: hung, or failing much later with only "Connection closed by peer". So each
phase runs on every rank, then the ranks exchange how it went (one small ``all_gather_object``)
and, if any failed, every rank raises the same :class:`~._errors.CheckpointError`, naming the
failing ranks, the phase and each cause, and saying what the failure left as it was. The
exchanges run at save and load only, never in a training step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from thunder_overlap.checkpoint._errors import ERROR_CLASSES, CheckpointError, RankFailure

__all__ = ["Operation"]

_T = TypeVar("_T")
_log = logging.getLogger(__name__)


@dataclass
class Operation:
    """One ``save`` or ``load`` (``name``) of ``path`` by every rank of ``group`` (None: this
    process alone). ``intact`` says, in an error, what a failure leaves as it was; a phase that
    changes that updates it."""

    name: str
    path: Path
    group: dist.ProcessGroup | None
    intact: str

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def run(self, doing: str, step: Callable[[], _T], *, cleanup: Callable[[], None] | None = None) -> _T:
        """``step()`` on this rank; returns its value once every rank's step succeeded. Otherwise
        every rank runs ``cleanup`` (if given) and raises the same error."""
        value, _ = self._phase(doing, step, cleanup, share=False)
        return value

    def gather(self, doing: str, step: Callable[[], _T], *, cleanup: Callable[[], None] | None = None) -> list[_T]:
        """As :meth:`run`, but returns every rank's value (picklable), by rank."""
        _, values = self._phase(doing, step, cleanup, share=True)
        return values

    def _phase(self, doing: str, step: Callable[[], Any], cleanup: Callable[[], None] | None, share: bool) -> tuple[Any, list[Any]]:
        value, failure, local_error = None, None, None
        try:
            value = step()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            failure, local_error = RankFailure.of(error), error
        outcomes = self._exchange(doing, (failure, value if share else None), failure)
        failures = {rank: f for rank, (f, _) in enumerate(outcomes) if f is not None}
        if failures:
            if cleanup is not None:
                try:
                    cleanup()
                except Exception:  # noqa: BLE001 - the error below is the one to report
                    _log.warning("%s: cleaning up after a failure %s failed", self.name, doing, exc_info=True)
            error = self._error(doing, failures)
            if isinstance(error, CheckpointException) and isinstance(local_error, CheckpointException):
                error._failures = local_error.failures  # torch's own, for code that reads them
            raise error from local_error
        return value, [v for _, v in outcomes]

    def _exchange(self, doing: str, outcome: tuple[RankFailure | None, Any], failure: RankFailure | None) -> list[Any]:
        if self.group is None:
            return [outcome]
        outcomes: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(outcomes, outcome, group=self.group)
        except Exception as error:
            here = f" (this rank: {failure.cause})" if failure is not None else ""
            raise CheckpointError(
                f"{self._subject()} lost the other ranks after {doing}{here}: {type(error).__name__}: {error} "
                f"(did a rank exit or crash?); {self.intact}"
            ) from error
        return outcomes

    def _subject(self) -> str:
        return f"{self.name}({str(self.path)!r})"

    def _error(self, doing: str, failures: dict[int, RankFailure]) -> CheckpointError:
        """The same error on every rank: the class the first failing rank's cause gives, and a
        message naming each failing rank (ranks with the same cause together)."""
        error_class = ERROR_CLASSES[failures[min(failures)].error_class]
        by_cause: dict[str, list[int]] = {}
        for rank, failure in sorted(failures.items()):
            by_cause.setdefault(failure.cause, []).append(rank)
        if self.group is None:
            where, causes = "", "; ".join(by_cause)
        elif len(by_cause) == 1:
            ((cause, ranks),) = by_cause.items()
            where, causes = f" on {_ranks(ranks)} of {self.world_size}", cause
        else:
            where, causes = "", "; ".join(f"{_ranks(ranks)}: {cause}" for cause, ranks in by_cause.items())
        every = "; every rank raised this error" if self.group is not None else ""
        message = f"{self._subject()} failed{where} while {doing}: {causes}{every}; {self.intact}"
        return error_class(message, {rank: f.cause for rank, f in failures.items()})


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
