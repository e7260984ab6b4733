"""A real slow link between two local ranks: two network namespaces joined by a veth pair whose
egress is rate-limited with ``tc htb`` on both ends (netem is not available here).

Only addresses inside the namespaces created here are used; nothing outside can reach them.
Everything is removed on exit, including when creation fails half-way. Needs root.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

__all__ = ["SlowLink", "LinkSpec"]

# A private /24 that exists only inside our namespaces (each namespace has its own routing table,
# so it cannot clash with the host's networks or with another testbed's namespaces).
_SUBNET = "10.213.0"
# Interface names are limited to 15 characters (IFNAMSIZ - 1).
_MAX_IFNAME = 15


@dataclass(frozen=True)
class LinkSpec:
    rate_mbit: float
    # Rank r runs pinned to core cores[r].
    cores: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"--rate-mbit must be positive, got {self.rate_mbit!r}")
        available = os.sched_getaffinity(0)
        bad = [c for c in self.cores if c not in available]
        if bad or len(set(self.cores)) != 2:
            raise ValueError(f"cores {self.cores} must be two distinct cores of this process's {sorted(available)}")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


class SlowLink:
    """``with SlowLink(spec) as link:`` creates the namespaces; ``link.command(rank, argv)`` runs
    ``argv`` inside rank's namespace pinned to its core, ``link.address(rank)`` is its address."""

    WORLD_SIZE = 2

    def __init__(self, spec: LinkSpec, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.spec = spec
        self.namespaces = [f"tovl{tag}-ns{r}" for r in range(self.WORLD_SIZE)]
        self.interfaces = [f"tovl{tag}v{r}" for r in range(self.WORLD_SIZE)]
        if any(len(name) > _MAX_IFNAME for name in self.interfaces):
            raise ValueError(f"tag {tag!r} makes interface names longer than {_MAX_IFNAME} characters")
        self._created: list[str] = []

    def address(self, rank: int) -> str:
        return f"{_SUBNET}.{rank + 1}"

    def interface(self, rank: int) -> str:
        return self.interfaces[rank]

    def command(self, rank: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[rank], "taskset", "-c", str(self.spec.cores[rank]), *argv]

    def __enter__(self) -> SlowLink:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
        veth0, veth1 = self.interfaces
        _run("ip", "link", "add", veth0, "type", "veth", "peer", "name", veth1)
        rate = f"{self.spec.rate_mbit}mbit"
        for rank, (ns, dev) in enumerate(zip(self.namespaces, self.interfaces, strict=True)):
            _run("ip", "link", "set", dev, "netns", ns)
            in_ns = ("ip", "netns", "exec", ns)
            _run(*in_ns, "ip", "addr", "add", f"{self.address(rank)}/24", "dev", dev)
            _run(*in_ns, "ip", "link", "set", dev, "up")
            _run(*in_ns, "ip", "link", "set", "lo", "up")
            _run(*in_ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
            _run(*in_ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate)

    def close(self) -> None:
        """Deletes the namespaces created here; their veth ends (and the qdiscs) go with them.
        If the pair was created but not yet moved, the host-side end is deleted too."""
        for dev in self.interfaces:
            subprocess.run(["ip", "link", "del", dev], capture_output=True)  # absent once moved: fine
        while self._created:
            subprocess.run(["ip", "netns", "del", self._created.pop()], capture_output=True)
