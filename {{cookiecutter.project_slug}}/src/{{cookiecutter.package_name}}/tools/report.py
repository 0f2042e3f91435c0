"""Curves and a summary of a run, or of several runs side by side.

    python -m {{ cookiecutter.package_name }}.tools.report runs/default          # report.png and report.md
    python -m {{ cookiecutter.package_name }}.tools.report runs/a runs/b --out cmp  # two runs on the same axes

Reads each run's metrics.jsonl and config.yaml. report.png shows train and eval loss, the
other eval metrics, learning rate, throughput and where the step time goes; report.md holds
steps, wall time, mean throughput, the best and final eval of task.MAIN_METRIC, the time per
step and the settings that matter. The figure needs matplotlib (the project's viz extra).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import task
from ..base import extras, records
from ..base.rules import ConfigError, exit_on_user_error
from ..base.rundir import RunDir
from ..config import upgrade
from ..loop.profiling import SPLIT

SETTINGS = (  # always shown; any other setting that differs between the runs compared is shown too
    "data.batch_size",
    "train.grad_accum_steps",
    "optim.lr",
    "optim.lr_scaling",
    "train.precision",
    "train.compile",
    "train.epochs",
    "train.max_steps",
)
IGNORED = ("run.name", "run.out_dir")  # differ between any two runs and say nothing


@dataclass
class Run:
    label: str
    train: list[dict]  # log windows, one per step, in step order
    evals: list[dict]  # evaluations, one per step, in step order
    wall_s: float | None  # summed over the attempts of a resumed run; None for logs without times
    settings: dict = field(default_factory=dict)  # "section.key" -> value, from config.yaml


def wall_time(logged: list[dict]) -> float | None:
    """Seconds of training over every attempt: each attempt's clock starts again at zero."""
    clocks = [
        r["summary"]["wall_s"] if r["kind"] == records.SUMMARY else r.get("elapsed_s")
        for r in logged
        if r["kind"] != records.EVAL
    ]
    if not clocks or any(c is None for c in clocks):
        return None
    total = 0.0
    for previous, current in zip(clocks, clocks[1:], strict=False):
        if current < previous:  # a new attempt began
            total += previous
    return total + clocks[-1]


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_run(run_dir: RunDir, label: str) -> Run:
    if not run_dir.metrics.exists():
        raise ConfigError(f"report: {run_dir.metrics} does not exist; pass a run directory such as runs/default")
    logged = records.read(run_dir.metrics)
    saved = yaml.safe_load(run_dir.config.read_text()) or {} if run_dir.config.exists() else {}
    settings = flatten(upgrade(saved)[0])  # a run made before the settings' sections were regrouped too
    timeline = records.current_timeline(logged)
    return Run(
        label=label,
        train=records.latest_per_step(records.of_kind(timeline, records.TRAIN)),
        evals=records.latest_per_step(records.of_kind(timeline, records.EVAL)),
        wall_s=wall_time(logged),
        settings=settings,
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def steady(run: Run) -> list[dict]:
    """The log windows without the first, which holds start-up costs (unless it is the only one)."""
    return run.train[1:] or run.train


def summary(runs: list[Run], main_metric: tuple[str, str]) -> str:
    """report.md: one column per run."""
    name, key = main_metric[0], records.EVAL_PREFIX + main_metric[0]
    rows = {
        "steps": [str(run.train[-1]["step"]) if run.train else "-" for run in runs],
        "world size": [str(run.train[-1].get("world_size", "-")) if run.train else "-" for run in runs],
        "wall time": [f"{run.wall_s:.1f} s" if run.wall_s is not None else "-" for run in runs],
        "mean throughput": [f"{mean([r['samples_per_s'] for r in run.train]):,.0f} samples/s" for run in runs],
    }
    scored = [records.best_and_final(run.evals, main_metric) for run in runs]
    rows[f"best eval {name}"] = [f"{s[0][key]:.4f} at step {s[0]['step']}" if s else "-" for s in scored]
    rows[f"final eval {name}"] = [f"{s[1][key]:.4f} at step {s[1]['step']}" if s else "-" for s in scored]
    rows["time per step"] = [time_split(run) for run in runs]
    for setting in shown_settings(runs):
        rows[setting] = [f"`{run.settings.get(setting, '-')}`" for run in runs]
    lines = ["# Run report", "", "| | " + " | ".join(run.label for run in runs) + " |"]
    lines.append("|---" * (len(runs) + 1) + "|")
    lines += [f"| {row} | " + " | ".join(cells) + " |" for row, cells in rows.items()]
    lines += ["", f"Mean throughput: over every log window. Time per step: {SPLIT_NOTE}", ""]
    return "\n".join(lines)


SPLIT_NOTE = (
    "mean over the log windows after the first, in ms; forward+backward includes the gradient "
    "all-reduce that backward could not hide (`diagnose scaling` separates it)."
)


def time_split(run: Run) -> str:
    windows = [r for r in steady(run) if "step_ms" in r]
    if not windows:
        return "-"
    parts = ", ".join(f"{label} {mean([r[key] for r in windows]):.2f}" for key, label in SPLIT.items())
    return f"{mean([r['step_ms'] for r in windows]):.2f} ms: {parts}"


def shown_settings(runs: list[Run]) -> list[str]:
    differing = {
        key
        for run in runs
        for key in run.settings
        if key not in IGNORED and len({repr(other.settings.get(key)) for other in runs}) > 1
    }
    return [key for key in SETTINGS if any(key in run.settings for run in runs)] + sorted(differing - set(SETTINGS))


def figure(runs: list[Run], path: Path) -> None:
    """report.png: six panels, every run in its own colour."""
    import matplotlib  # the optional dependency, imported only when a figure is drawn

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), layout="constrained")
    (loss, metrics, lr), (speed, split, wait) = axes
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(runs):
        colour = colours[index % len(colours)]
        steps = [r["step"] for r in run.train]
        loss.plot(steps, [r["loss"] for r in run.train], color=colour, label=f"{run.label} train")
        eval_steps = [e["step"] for e in run.evals]
        evals = [records.eval_metrics(e) for e in run.evals]
        if evals and "loss" in evals[0]:
            loss.plot(eval_steps, [e["loss"] for e in evals], "o--", color=colour, label=f"{run.label} eval")
        for style, name in zip(("o-", "s-", "^-", "d-"), eval_metric_names(evals), strict=False):
            metrics.plot(eval_steps, [e.get(name) for e in evals], style, color=colour, label=f"{run.label} {name}")
        lr.plot(steps, [r["lr"] for r in run.train], color=colour, label=run.label)
        speed.plot(steps, [r["samples_per_s"] for r in run.train], color=colour, label=run.label)
        wait.plot(steps, [100 * r["data_wait_share"] for r in run.train], color=colour, label=run.label)
    stacked_split(split, runs)
    titles = (
        (loss, "loss (train: per log window; eval: markers)", "loss"),
        (metrics, "eval metrics", "value"),
        (lr, "learning rate", "lr"),
        (speed, "throughput", "samples/s"),
        (wait, "data wait", "% of step time"),
    )
    for ax, title, unit in titles:
        ax.set(title=title, xlabel="optimizer step", ylabel=unit)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def eval_metric_names(evals: list[dict]) -> list[str]:
    """The task's evaluation metrics besides the loss (its own panel)."""
    return sorted({name for metrics in evals for name in metrics if name != "loss"})


def stacked_split(ax, runs: list[Run]) -> None:
    """One bar per run: its mean step time, split into data wait, forward+backward, optimizer, other."""
    bottoms = [0.0] * len(runs)
    for key, label in SPLIT.items():
        heights = [mean([r.get(key, 0.0) for r in steady(run)]) for run in runs]
        ax.bar([run.label for run in runs], heights, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set(title="where a step's time goes (fwd+bwd includes exposed all-reduce)", ylabel="ms per step")
    ax.legend(fontsize="small")


def labels(run_dirs: list[Path]) -> list[str]:
    """Run names, or paths where two runs share a name."""
    names = [d.name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (out_dir/name), each with metrics.jsonl")
    parser.add_argument("--out", type=Path, help="where report.png and report.md go (default: the run, or ./report)")
    args = parser.parse_args(argv)
    out = args.out or (args.runs[0] if len(args.runs) == 1 else Path("report"))
    with exit_on_user_error():
        runs = [read_run(RunDir(path), label) for path, label in zip(args.runs, labels(args.runs), strict=True)]
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(summary(runs, task.MAIN_METRIC))
        print(f"wrote {out / 'report.md'}")
        extras.require("matplotlib", "report.png")
    figure(runs, out / "report.png")
    print(f"wrote {out / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
