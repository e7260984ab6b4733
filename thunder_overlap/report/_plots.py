"""Pictures of a :class:`~thunder_overlap.report._report.Report`: a Chrome trace and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from thunder_overlap._analysis.classify import NodeKind

__all__ = ["write_chrome_trace", "write_png"]

_MIB = 2**20
# Chrome traces count in microseconds.
_US_PER_MS = 1000.0


def _order_reports(report):
    """(order name, [(pass name, OrderReport, time offset ms)]) with the backward after the forward."""
    for position in range(len(report.passes[0].orders)):
        offset, items = 0.0, []
        for p in report.passes:
            r = p.orders[position]
            items.append((p.name, r, offset))
            offset += r.predicted_ms
        yield items[0][1].order, items


def write_chrome_trace(report, path: Path) -> None:
    events: list[dict] = []
    for pid, (order, items) in enumerate(_order_reports(report), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"{order} order"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
        streams: set[int] = set()
        for pass_name, r, offset in items:
            nodes = r.annotated.nodes
            memory = r.memory_after_node()
            for op in r.simulation.ops:
                node = nodes[op.node]
                ts = (offset + op.start_ms) * _US_PER_MS
                if op.end_ms > op.start_ms:
                    name = f"wait {node.name}" if node.kind is NodeKind.WAIT else node.name
                    events.append(
                        {
                            "ph": "X",
                            "pid": pid,
                            "tid": 0,
                            "name": name,
                            "cat": pass_name,
                            "ts": ts,
                            "dur": (op.end_ms - op.start_ms) * _US_PER_MS,
                        }
                    )
                events.append(
                    {
                        "ph": "C",
                        "pid": pid,
                        "name": "live memory",
                        "ts": (offset + op.end_ms) * _US_PER_MS,
                        "args": {"MiB": memory[op.node] / _MIB},
                    }
                )
            for c in r.simulation.collectives:
                streams.add(c.stream)
                events.append({
                    "ph": "X", "pid": pid, "tid": 1 + c.stream, "name": f"{c.kind} #{c.collective}", "cat": pass_name,
                    "ts": (offset + c.start_ms) * _US_PER_MS, "dur": c.duration_ms * _US_PER_MS,
                    "args": {"bytes": c.unsharded_bytes, "exposed_ms": c.exposed_ms, "potentially_hideable": c.potentially_hideable},
                })  # fmt: skip
        for s in sorted(streams):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1 + s, "args": {"name": f"communication (group {s})"}})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def write_png(report, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # matplotlib is a dependency, but a trimmed install may lack it
        raise RuntimeError("Report.to_png needs matplotlib: pip install matplotlib") from e

    orders = list(_order_reports(report))
    fig, axes = plt.subplots(len(orders) + 1, 1, figsize=(12, 2.2 * len(orders) + 3), sharex=True)
    for ax, (order, items) in zip(axes, orders, strict=False):  # the last axis holds memory
        for _pass_name, r, offset in items:
            compute, stalls = [], []
            for op in r.simulation.ops:
                node = r.annotated.nodes[op.node]
                # A wait stalls first, then runs its bucket's copy-out (if any) as compute.
                stalled = r.simulation.collectives[node.collective].exposed_ms if node.kind is NodeKind.WAIT else 0.0
                if stalled > 0:
                    stalls.append((offset + op.start_ms, stalled))
                if op.end_ms > op.start_ms + stalled:
                    compute.append((offset + op.start_ms + stalled, op.end_ms - op.start_ms - stalled))
            ax.broken_barh(compute, (2, 0.8), color="tab:blue")
            ax.broken_barh(stalls, (2, 0.8), color="tab:red")
            comm = [(offset + c.start_ms, c.duration_ms) for c in r.simulation.collectives]
            ax.broken_barh(comm, (1, 0.8), color="tab:orange")
        ax.set_yticks([1.4, 2.4], ["communication", "compute"])
        ax.set_title(f"{order} order: compute (blue), waiting (red), collectives (orange)", fontsize=9)
    memory_ax = axes[-1]
    for order, items in orders:
        times, values = [], []
        for _, r, offset in items:
            memory = r.memory_after_node()
            for op in r.simulation.ops:
                times.append(offset + op.end_ms)
                values.append(memory[op.node] / _MIB)
        memory_ax.plot(times, values, label=order, drawstyle="steps-post")
    memory_ax.set_ylabel("live MiB")
    memory_ax.set_xlabel("predicted time (ms), forward then backward")
    memory_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
