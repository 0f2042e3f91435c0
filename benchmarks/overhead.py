"""The generated training loop against a bare, hand-written DDP loop, side by side.

    python benchmarks/overhead.py            # fp32, bf16, accumulation 4; 8 pairs of 200-step chunks, 8 launch pairs
    python benchmarks/overhead.py --quick    # seconds: one setting, little of each (run by the template tests)

Bakes a default project; the bare loop (bare_loop.py) trains the same model on the same data
with the same sampler, optimizer, schedule, precision, accumulation and clipping, written the
shortest correct way. Everything runs under torchrun on 2 CPU processes of 1 thread.
- Steady state: one launch per setting builds both loops and alternates chunks of optimizer
  steps between them (interleaved.py), so drifts in machine load hit both alike; the ratio is
  bare chunk time / our chunk time (above 1: ours is faster).
- Start-up: separate launches, ours (the project's `train.main`) and bare alternately, timed
  from launch to the first optimizer step.
Machines here are noisy: read the medians and the spread.
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
SETTINGS = {  # every optional output off, except in the row that states TensorBoard's cost
    "fp32": ["train.precision=fp32"],
    "bf16": ["train.precision=bf16"],
    "fp32 accum4": ["train.precision=fp32", "train.grad_accum_steps=4"],
    "fp32 + TensorBoard": ["train.precision=fp32", "run.tensorboard=true"],
    "fp32, bare on foreach AdamW": ["train.precision=fp32"],  # the gain of fused AdamW on CPU
}
BARE_ADAMW = {"fp32, bare on foreach AdamW": "foreach"}  # the bare loop's AdamW where not fused


def torchrun(script: Path | str, *args: str, python: str = sys.executable) -> list[str]:
    """The command line of a job of 2 CPU processes."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]


def bake(out: Path) -> Path:
    return bake_task(out, "classifier")


def bake_task(out: Path, task: str) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(out), extra_context={"task": task}))


LOOPS = {
    "ours": "timed_train.py",
    "bare": "bare_loop.py",
    "fabric": "fabric_loop.py",
    "accelerate": "accelerate_loop.py",
}


def launch(
    project: Path, variant: str, overrides: list[str], out: Path, steps: int, python: str = sys.executable
) -> dict:
    """One torchrun job of LOOPS[variant]; returns rank 0's launch time and per-step timestamps."""
    timings = out / f"{variant}-{time.monotonic_ns()}.json"
    script = HERE / LOOPS[variant]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{project / 'src'}{os.pathsep}{HERE}",
        BENCH_TIMINGS=str(timings),
        BENCH_LAUNCH=repr(time.time()),
    )
    command = torchrun(
        script,
        "--config",
        str(project / "configs" / "default.yaml"),
        *common_overrides(out, steps),
        *overrides,  # after the common ones, so a setting can switch an output back on
        python=python,
    )
    subprocess.run(command, cwd=project, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return json.loads(timings.read_text())


def common_overrides(out: Path, steps: int) -> list[str]:
    # one long epoch (no eval or epoch boundary in the timed window), no checkpoint inside it
    return [
        f"run.out_dir={out}",
        "run.name=bench",
        f"train.max_steps={steps}",
        "train.epochs=1",
        "dataset.train_samples=200000",
        "checkpoint.resume=never",
        f"checkpoint.every_steps={steps}",
        "data.num_workers=0",
        "parallel.sync_batchnorm=false",
        "run.tensorboard=false",
    ]


def summarise(record: dict, warmup: int) -> tuple[float, float]:
    """(steady-state steps/s, seconds from launch to the first optimizer step)."""
    stamps = record["step_times"]
    steady = (len(stamps) - 1 - warmup) / (stamps[-1] - stamps[warmup])
    return steady, stamps[0] - record["launch"]


def steady_state(project: Path, overrides: list[str], out: Path, chunks: int, chunk_steps: int) -> dict:
    timings = out / f"interleaved-{time.monotonic_ns()}.json"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{project / 'src'}{os.pathsep}{HERE}", BENCH_TIMINGS=str(timings)
    )
    steps = (chunks * 2 + 2) * chunk_steps
    command = torchrun(
        HERE / "interleaved.py",
        "--config",
        str(project / "configs" / "default.yaml"),
        "--chunks",
        str(chunks),
        "--chunk-steps",
        str(chunk_steps),
        *common_overrides(out, steps),
        *overrides,
    )
    subprocess.run(command, cwd=project, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1200)
    return json.loads(timings.read_text())


def measure(project: Path, settings: dict, chunks: int, chunk_steps: int, pairs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, overrides in settings.items():
            os.environ["BARE_ADAMW"] = BARE_ADAMW.get(name, "fused")  # the launches below inherit it
            chunk = steady_state(project, overrides, Path(scratch), chunks, chunk_steps)
            pairs_of_chunks = list(zip(chunk["ours"], chunk["bare"], strict=True))
            ratios = [bare[0] / ours[0] for ours, bare in pairs_of_chunks]
            cpu_ratios = [bare[1] / ours[1] for ours, bare in pairs_of_chunks]
            startup = {"ours": [], "bare": []}
            for _ in range(pairs):
                for variant in ("ours", "bare"):
                    startup[variant].append(summarise(launch(project, variant, overrides, Path(scratch), 3), 0)[1])
            rows.append(
                {
                    "setting": name,
                    "ours_steps_per_s": chunk_steps / statistics.median(wall for wall, _ in chunk["ours"]),
                    "bare_steps_per_s": chunk_steps / statistics.median(wall for wall, _ in chunk["bare"]),
                    "steady_ratio": statistics.median(ratios),
                    "steady_spread": (min(ratios), max(ratios)),
                    "cpu_ratio": statistics.median(cpu_ratios),
                    "cpu_spread": (min(cpu_ratios), max(cpu_ratios)),
                    "ours_startup_s": statistics.median(startup["ours"]),
                    "bare_startup_s": statistics.median(startup["bare"]),
                    "startup_ratio": statistics.median(
                        o / b for o, b in zip(startup["ours"], startup["bare"], strict=True)
                    ),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| setting | ours steps/s | bare steps/s | speed ratio ours/bare, wall (min-max) | "
        "speed ratio ours/bare, CPU time (min-max) | launch->first step ours / bare | start-up ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        (low, high), (cpu_low, cpu_high) = r["steady_spread"], r["cpu_spread"]
        lines.append(
            f"| {r['setting']} | {r['ours_steps_per_s']:.1f} | {r['bare_steps_per_s']:.1f} | "
            f"{r['steady_ratio']:.3f} ({low:.3f}-{high:.3f}) | {r['cpu_ratio']:.3f} ({cpu_low:.3f}-{cpu_high:.3f}) | "
            f"{r['ours_startup_s']:.2f} s / {r['bare_startup_s']:.2f} s | {r['startup_ratio']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one setting, little of each")
    parser.add_argument("--chunks", type=int, default=8, help="chunk pairs per setting")
    parser.add_argument("--chunk-steps", type=int, default=200, help="optimizer steps per chunk")
    parser.add_argument("--pairs", type=int, default=8, help="launch pairs per setting for start-up")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    settings, chunks, chunk_steps, pairs = SETTINGS, args.chunks, args.chunk_steps, args.pairs
    if args.quick:
        settings, chunks, chunk_steps, pairs = {"fp32": SETTINGS["fp32"]}, 2, 10, 1
    with tempfile.TemporaryDirectory() as out:
        project = bake(Path(out))
        rows = measure(project, settings, chunks, chunk_steps, pairs)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
