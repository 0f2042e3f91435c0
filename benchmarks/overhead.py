"""The generated training loop against a bare, hand-written DDP loop, side by side.

    python benchmarks/overhead.py            # full: fp32, bf16, accumulation 4; 5 interleaved pairs each
    python benchmarks/overhead.py --quick    # seconds: one setting, one pair (run by the template tests)

Bakes a default project, then launches A (the project's own `train.main`) and B (the loop in
bare_loop.py: the same model, data, sampler, optimizer, precision and accumulation, written
the shortest correct way) alternately, A B A B ..., each with torchrun on 2 CPU processes of
1 thread. Both record a timestamp after every optimizer step in the same way, so the figures
are ratios of like with like: steady-state steps/s (after warm-up steps) and the time from
launch to the first optimizer step. Machines here are noisy: read the medians and spreads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent
SETTINGS = {
    "fp32": ["train.precision=fp32"],
    "bf16": ["train.precision=bf16"],
    "fp32 accum4": ["train.precision=fp32", "train.grad_accum_steps=4"],
}


def bake(out: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out)))


LOOPS = {"ours": "timed_train.py", "bare": "bare_loop.py", "fabric": "fabric_loop.py",
         "accelerate": "accelerate_loop.py"}


def launch(project: Path, variant: str, overrides: list[str], out: Path, steps: int,
           python: str = sys.executable) -> dict:
    """One torchrun job of LOOPS[variant]; returns rank 0's launch time and per-step timestamps."""
    timings = out / f"{variant}-{time.monotonic_ns()}.json"
    script = HERE / LOOPS[variant]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{project / 'src'}{os.pathsep}{HERE}",
               BENCH_TIMINGS=str(timings), BENCH_LAUNCH=repr(time.time()))
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               "--config", str(project / "configs" / "default.yaml"), *overrides, *common_overrides(out, steps)]
    subprocess.run(command, cwd=project, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return json.loads(timings.read_text())


def common_overrides(out: Path, steps: int) -> list[str]:
    # one long epoch (no eval or epoch boundary in the timed window), no checkpoint inside it
    return [f"run.out_dir={out}", "run.name=bench", f"train.max_steps={steps}", "train.epochs=1",
            "data.train_samples=200000", "checkpoint.resume=never", f"checkpoint.every_steps={steps}",
            "data.num_workers=0", "train.sync_batchnorm=false"]


def summarise(record: dict, warmup: int) -> tuple[float, float]:
    """(steady-state steps/s, seconds from launch to the first optimizer step)."""
    stamps = record["step_times"]
    steady = (len(stamps) - 1 - warmup) / (stamps[-1] - stamps[warmup])
    return steady, stamps[0] - record["launch"]


def measure(project: Path, pairs: int, steps: int, warmup: int, settings: dict) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, overrides in settings.items():
            runs = {"ours": [], "bare": []}
            for _ in range(pairs):  # interleaved, so drifts in machine load hit both alike
                for variant in ("ours", "bare"):
                    runs[variant].append(summarise(launch(project, variant, overrides, Path(scratch), steps), warmup))
            ratios = [a[0] / b[0] for a, b in zip(runs["ours"], runs["bare"], strict=True)]
            startup = [a[1] / b[1] for a, b in zip(runs["ours"], runs["bare"], strict=True)]
            rows.append({
                "setting": name,
                "ours_steps_per_s": statistics.median(r[0] for r in runs["ours"]),
                "bare_steps_per_s": statistics.median(r[0] for r in runs["bare"]),
                "steady_ratio": statistics.median(ratios), "steady_spread": (min(ratios), max(ratios)),
                "ours_startup_s": statistics.median(r[1] for r in runs["ours"]),
                "bare_startup_s": statistics.median(r[1] for r in runs["bare"]),
                "startup_ratio": statistics.median(startup),
            })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| setting | ours steps/s | bare steps/s | steady ratio ours/bare (min-max) | "
             "launch->first step ours / bare | start-up ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["steady_spread"]
        lines.append(f"| {r['setting']} | {r['ours_steps_per_s']:.1f} | {r['bare_steps_per_s']:.1f} | "
                     f"{r['steady_ratio']:.3f} ({low:.3f}-{high:.3f}) | {r['ours_startup_s']:.2f} s / "
                     f"{r['bare_startup_s']:.2f} s | {r['startup_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one setting, one pair, few steps")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=330)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    pairs, steps, settings = args.pairs, args.steps, SETTINGS
    if args.quick:
        pairs, steps, settings = 1, 40, {"fp32": SETTINGS["fp32"]}
    warmup = max(5, steps // 10)
    with tempfile.TemporaryDirectory() as out:
        project = bake(Path(out))
        rows = measure(project, pairs, steps, warmup, settings)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
