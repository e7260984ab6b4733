"""What one collective launch costs on the slow-link testbed, and how many gloo runs at once.

    sudo python benchmarks/link_probe.py --rate-mbit 400 --out benchmarks/measured/slow_link/link_probe.json

Two ranks across the testbed's link (fsdp_bench/netns.py) all-gather the same bytes split into
more or fewer launches, waiting for each before the next (one in flight) or keeping two or three
in flight, like a schedule's prefetch does. Three things come out of it, per size:
- the fixed cost of one launch: small launches one at a time, less their bytes over the rate;
- whether launches in flight together hide each other's fixed cost: gloo runs them on its worker
  threads, so with two in flight the link moves as many bytes per second with many small launches
  as with a few large ones;
- what a coalesced launch (``torch.distributed._coalescing_manager``) costs against separate ones.
The cost model's ``NetworkProfile.concurrent_launches`` and the testbed's ``--link-latency-us``
rest on these figures (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPEATS = 7
_WARMUP = 2
# Total unsharded bytes of each measurement, and how many launches they are split into.
_SMALL_TOTAL_KB = 50
_SMALL_SPLITS = (1, 4, 16)
_LARGE_TOTAL_KB = 6400
_LARGE_SPLITS = (8, 16, 32, 64)
_IN_FLIGHT = (1, 2, 3)


def _median_ms(fn) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(_WARMUP + _REPEATS):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[_WARMUP:]) * 1e3


def _gathers(total_kb: int, launches: int):
    import torch

    numel = total_kb * 1024 // 4 // launches // 2 * 2
    return [(torch.empty(numel), torch.ones(numel // 2)) for _ in range(launches)]


def _windowed(buffers, in_flight: int):
    import torch.distributed as dist

    def run() -> None:
        pending = []
        for out, shard in buffers:
            pending.append(dist.all_gather_into_tensor(out, shard, async_op=True))
            if len(pending) >= in_flight:
                pending.pop(0).wait()
        for work in pending:
            work.wait()

    return run


def _coalesced(buffers):
    import torch.distributed as dist

    def run() -> None:
        with dist._coalescing_manager(async_ops=True) as manager:
            for out, shard in buffers:
                dist.all_gather_into_tensor(out, shard)
        manager.wait()

    return run


def _rank_main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rows = []
    for total_kb, splits in ((_SMALL_TOTAL_KB, _SMALL_SPLITS), (_LARGE_TOTAL_KB, _LARGE_SPLITS)):
        for launches in splits:
            buffers = _gathers(total_kb, launches)
            row = {"total_kb": total_kb, "launches": launches, "launch_kb": total_kb / launches}
            for k in _IN_FLIGHT:
                row[f"in_flight_{k}_ms"] = _median_ms(_windowed(buffers, k))
            row["coalesced_ms"] = _median_ms(_coalesced(buffers))
            rows.append(row)
    if dist.get_rank() == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=float, default=400.0)
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("link_probe.py creates network namespaces and qdiscs: run it as root")

    from fsdp_bench.launch import rank_env
    from fsdp_bench.netns import LinkSpec, SlowLink

    with SlowLink(LinkSpec(args.rate_mbit)) as link:
        argv0 = [sys.executable, str(Path(__file__).resolve()), "--rank-worker"]
        procs = [
            subprocess.Popen(link.command(r, argv0), env=rank_env(link, r), stdout=subprocess.PIPE, text=True)
            for r in range(link.WORLD_SIZE)
        ]
        outputs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    rows = json.loads(outputs[0].strip().splitlines()[-1])
    result = {"rate_mbit": args.rate_mbit, "repeats": _REPEATS, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'launches':>8} {'KB each':>8} " + " ".join(f"{f'{k} in flight':>12}" for k in _IN_FLIGHT) + f" {'coalesced':>10}")
    for row in rows:
        cells = " ".join(f"{row[f'in_flight_{k}_ms']:9.2f} ms" for k in _IN_FLIGHT)
        print(f"{row['launches']:>8} {row['launch_kb']:>8.1f} {cells} {row['coalesced_ms']:7.2f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank-worker"]:
        _rank_main()
    else:
        main(sys.argv[1:])
