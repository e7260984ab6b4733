"""Where a slow-link step's time over max(C, M) goes: each collective's exposure, as simulated.

    python benchmarks/testbed_exposure.py benchmarks/measured/slow_link/grad_clip \
        --impl thunder_overlap@block --bucketings block,layer,auto --out exposure.json

Reads a testbed run's directory (``benchmarks/slow_link.py --out``): its calibration (C, each
bucketing strategy's M, C and M at once) and settings. Simulates the implementation's traces with
the simulator calibrated exactly as the testbed's prediction is (fsdp_bench/prediction.py), and
prints, per pass, every collective's size, when it ran and what the compute stream spent blocked
at its wait. ``--bucketings`` simulates other bucketing strategies under the same calibration, to
ask what they would change before measuring them (their prediction is only as good as the link
fitted to the strategies measured). Needs no root: it measures nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slow_link import TestbedConfig, file_label, prediction_setting, split_label

from fsdp_bench.bench_config import BUCKETING_MODES
from fsdp_bench.prediction import TestbedSetting, simulate_testbed
from fsdp_bench.testbed_summary import SlowLinkCalibration


def setting_of_run(run_dir: Path, label: str, bucketing: str) -> TestbedSetting:
    """The prediction's setting for ``label`` of the testbed run in ``run_dir``, calibrated to its
    measurements, simulating ``bucketing`` buckets."""
    summary = json.loads((run_dir / "summary.json").read_text())
    config = TestbedConfig(**{**summary["config"], "impls": tuple(summary["config"]["impls"])})
    if label not in config.impls:
        raise ValueError(f"--impl {label!r}: {run_dir} measured {', '.join(config.impls)}")
    if bucketing not in BUCKETING_MODES:
        raise ValueError(f"--bucketings: {bucketing!r} is not a bucketing strategy; accepted: {', '.join(BUCKETING_MODES)}")
    # The testbed measured communication alone with every measured label's bucketing.
    calibrations = summary["calibration_by_bucketing"]
    measured = split_label(label)[1]
    run = json.loads((run_dir / "runs" / f"round0_{file_label(label)}.json").read_text())
    comm_ms_by_bucketing = {b: c["comm_ms"] for b, c in calibrations.items()}
    return prediction_setting(config, label, run_dir, run, SlowLinkCalibration(**calibrations[measured]), comm_ms_by_bucketing, bucketing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a benchmarks/slow_link.py --out directory")
    parser.add_argument("--impl", default="thunder_overlap@block", help="the label whose calibration and run settings to use")
    parser.add_argument("--bucketings", default=None, help="comma-separated strategies to simulate (default: the label's own)")
    parser.add_argument("--out", type=Path, default=None, help="where to write every collective's timing (JSON)")
    args = parser.parse_args()
    bucketings = args.bucketings.split(",") if args.bucketings else [split_label(args.impl)[1]]
    measured = {s["impl"]: s["median_ms"] for s in json.loads((args.run_dir / "summary.json").read_text())["implementations"]}
    report = {}
    for bucketing in bucketings:
        try:
            setting = setting_of_run(args.run_dir, args.impl, bucketing)
        except ValueError as e:
            parser.error(str(e))
        simulations = simulate_testbed(setting)
        if simulations is None:
            parser.error(f"--impl {args.impl}: only Thunder traces are simulated")
        step_ms = sum(s.step_ms for s in simulations)
        ideal_ms = max(setting.compute_ms, setting.comm_ms)
        print(f"{args.impl} simulated with {bucketing} buckets: {step_ms:.1f} ms ({step_ms / ideal_ms:.3f} x max(C, M) = {ideal_ms:.1f})")
        passes = {}
        for name, simulation in zip(("forward", "backward"), simulations, strict=True):
            exposed = [c for c in simulation.collectives if c.exposed_ms > 0.05]
            print(f"  {name}: {simulation.step_ms:.1f} ms, compute {simulation.compute_ms:.1f}, {len(simulation.collectives)} collectives")
            for c in exposed:
                print(
                    f"    {c.kind:<14} {c.unsharded_bytes / 2**20:6.2f} MiB  ran {c.start_ms:6.1f}-{c.end_ms:6.1f} ms  "
                    f"exposed {c.exposed_ms:5.1f} ms"
                )
            passes[name] = {
                "step_ms": simulation.step_ms,
                "compute_ms": simulation.compute_ms,
                "collectives": [
                    {field: getattr(c, field) for field in ("kind", "unsharded_bytes", "start_ms", "end_ms", "exposed_ms")}
                    for c in simulation.collectives
                ],
            }
        report[bucketing] = {"step_ms": step_ms, "ideal_ms": ideal_ms, "passes": passes}
    if args.impl in measured:
        print(f"measured {args.impl}: {measured[args.impl]:.1f} ms (median of the rounds)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        written = {"run_dir": str(args.run_dir), "impl": args.impl, "measured_ms": measured.get(args.impl), "simulated": report}
        args.out.write_text(json.dumps(written, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
