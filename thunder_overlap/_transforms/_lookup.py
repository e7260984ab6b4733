"""Finding one of thunder_overlap's transforms on a module ``thunder_overlap.fsdp`` returned."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

__all__ = ["transform_of"]


def transform_of(module, kind: type[T]) -> T | None:
    """The transform of type ``kind`` that ``module`` (a ThunderModule) was compiled with, if any."""
    from thunder import compile_data

    return next((t for t in compile_data(module).transforms if isinstance(t, kind)), None)
