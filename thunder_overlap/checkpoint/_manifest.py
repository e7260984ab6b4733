"""A checkpoint's manifest: every file's size and CRC32, written at save, verified at load.

torch.distributed.checkpoint reads what its index points at and checks nothing else: 4 bytes
flipped inside a data file loaded without error, parameters off by thousands. The manifest
(``.manifest.json`` beside DCP's ``.metadata``) lists every file of the checkpoint directory,
``.metadata`` included, with its size and ``zlib.crc32``, streamed in chunks. CRC32 catches every burst of up
to 32 flipped bits and all but 1 in 2**32 other changes; it guards against damage, not tampering.

The ranks share the work: of the files sorted by name, rank r checksums (or verifies) every
world-size-th one from the r-th, and the ranks exchange their results (``_agreement``).
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from thunder_overlap.checkpoint._errors import CorruptCheckpointError

__all__ = [
    "MANIFEST_FILE",
    "METADATA_FILE",
    "FileEntry",
    "checksum_files",
    "describe_unreadable_files",
    "list_files",
    "read_manifest",
    "share",
    "verify_files",
    "write_manifest",
]

# DCP's file naming its index; a directory without it is no checkpoint.
METADATA_FILE = ".metadata"
MANIFEST_FILE = ".manifest.json"
_FORMAT = "thunder_overlap checkpoint manifest"
_VERSION = 1
_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file as the manifest records it."""

    size: int
    crc32: int

    def describe(self) -> str:
        return f"{self.size} bytes, CRC32 {self.crc32:#010x}"


def list_files(directory: Path) -> list[str]:
    """Every file of the checkpoint in ``directory`` (but the manifest), sorted."""
    return sorted(entry.name for entry in os.scandir(directory) if entry.is_file() and entry.name != MANIFEST_FILE)


def share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` checksums or verifies."""
    return names[rank::world_size]


def checksum(path: Path) -> FileEntry:
    """Size and CRC32 of the file at ``path``, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return FileEntry(size, crc)


def checksum_files(directory: Path, names: list[str]) -> dict[str, FileEntry]:
    return {name: checksum(directory / name) for name in names}


def write_manifest(directory: Path, entries: dict[str, FileEntry]) -> None:
    """Writes the manifest of ``entries`` into ``directory`` (flushed to disk: it is published
    with the files it describes)."""
    document = {
        "format": _FORMAT,
        "version": _VERSION,
        "checksum": "crc32",
        "files": {name: {"size": e.size, "crc32": e.crc32} for name, e in sorted(entries.items())},
    }
    with open(directory / MANIFEST_FILE, "w") as file:
        json.dump(document, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def read_manifest(directory: Path) -> dict[str, FileEntry] | None:
    """The manifest's entries; None for a checkpoint written without one (before manifests)."""
    path = directory / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text())
        if document.get("format") != _FORMAT or document.get("version") != _VERSION:
            raise ValueError(f"format {document.get('format')!r} version {document.get('version')!r}")
        return {name: FileEntry(int(e["size"]), int(e["crc32"])) for name, e in document["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpointError(f"the manifest {path} is unreadable ({type(error).__name__}: {error})") from error


def verify_files(directory: Path, manifest: dict[str, FileEntry], names: list[str]) -> None:
    """Checks the files ``names`` against the manifest; raises naming every file that differs,
    with both sizes or both checksums."""
    problems = []
    for name in names:
        recorded, path = manifest[name], directory / name
        if not path.is_file():
            problems.append(f"{name} is missing (the manifest records {recorded.describe()})")
            continue
        size = path.stat().st_size
        if size != recorded.size:
            problems.append(f"{name} is {size} bytes, the manifest records {recorded.size}")
            continue
        found = checksum(path)
        if found.crc32 != recorded.crc32:
            problems.append(f"{name} has CRC32 {found.crc32:#010x}, the manifest records {recorded.crc32:#010x} ({size} bytes)")
    if problems:
        raise CorruptCheckpointError(f"the checkpoint at {directory} is damaged: {'; '.join(problems)}")


def describe_unreadable_files(directory: Path, metadata: Metadata) -> str:
    """After torch failed to read a checkpoint: the files its index needs that are missing or
    shorter than the data it places in them (checked by size, nothing read); "" if none."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size < end:
            problems.append(f"{name} is {path.stat().st_size} bytes, but the index places data up to byte {end} (truncated)")
    return "; ".join(problems)
