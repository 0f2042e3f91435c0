"""`python -m <package>.tools.report`: a figure and a summary whose figures are those of metrics.jsonl."""

import json
import sys

import pytest
import yaml
from conftest import PACKAGE, SMOKE_CONFIG, read_metrics, run, train_args

from {{ cookiecutter.package_name }} import config, task
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.tools import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def window(step: int, start_step: int, elapsed: float, loss: float) -> dict:
    split = {"step_ms": 10.0, "data_wait_ms": 1.0, "fwd_bwd_ms": 6.0, "optimizer_ms": 2.0, "other_ms": 1.0}
    return {
        "kind": "train",
        "step": step,
        "epoch": 0,
        "loss": loss,
        "lr": 0.01,
        "samples_per_s": 100.0 * step,
        "data_wait_share": 0.1,
        **split,
        "world_size": 2,
        "start_step": start_step,
        "elapsed_s": elapsed,
    }


def write_resumed_run(run_dir, lr=0.01):
    """Attempt 1 logs steps 5-30 and an eval at 30, then dies; attempt 2 resumes from step 20."""
    first = [window(s, 0, s / 10, 2.0) for s in range(5, 35, 5)] + [
        {"kind": "eval", "step": 30, "eval_accuracy": 0.9, "eval_samples": 9}
    ]
    second = [window(s, 20, (s - 20) / 10, 1.0) for s in range(25, 45, 5)]
    second += [{"kind": "eval", "step": 40, "epoch": 0, "eval_loss": 0.5, "eval_accuracy": 0.8, "eval_samples": 9}]
    second += [{"kind": "summary", "step": 40, "summary": {"steps": 40, "wall_s": 2.5, "samples_per_s": 1.0}}]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + second))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"run": {"name": run_dir.name}, "optim": {"lr": lr}}))


def test_a_resumed_attempt_supersedes_what_was_logged_after_its_checkpoint(tmp_path):
    write_resumed_run(tmp_path / "a")
    loaded = report.read_run(RunDir(tmp_path / "a"), "a")
    assert [r["step"] for r in loaded.train] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert [r["loss"] for r in loaded.train] == [2.0] * 4 + [1.0] * 4
    assert [e["step"] for e in loaded.evals] == [40]  # the eval at 30 belonged to the superseded attempt
    assert loaded.wall_s == pytest.approx(3.0 + 2.5)  # both attempts' clocks


def test_the_summary_compares_runs_and_shows_the_settings_that_differ(tmp_path):
    write_resumed_run(tmp_path / "a", lr=0.01)
    write_resumed_run(tmp_path / "b", lr=0.03)
    text = report.summary([report.read_run(RunDir(tmp_path / name), name) for name in "ab"], ("accuracy", "max"))
    assert "| | a | b |" in text and "| optim.lr | `0.01` | `0.03` |" in text
    assert "| steps | 40 | 40 |" in text and "| wall time | 5.5 s | 5.5 s |" in text
    assert "| best eval accuracy | 0.8000 at step 40 | 0.8000 at step 40 |" in text
    assert "10.00 ms: data wait 1.00, forward+backward 6.00, optimizer 2.00, other 1.00" in text


@pytest.mark.slow  # matplotlib's first import builds its font cache
def test_two_runs_on_one_figure(tmp_path):
    write_resumed_run(tmp_path / "a", lr=0.01)
    write_resumed_run(tmp_path / "b", lr=0.03)
    assert report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "report.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "| | a | b |" in (tmp_path / "cmp" / "report.md").read_text()


@pytest.mark.slow
def test_report_of_a_real_run_matches_its_metrics(tmp_path):
    run([sys.executable, *train_args(tmp_path, "train.max_steps=null", "run.log_every=16")])  # 2 epochs, 2 evals
    result = run([sys.executable, "-m", f"{PACKAGE}.tools.report", str(tmp_path / "smoke")])
    assert (tmp_path / "smoke" / "report.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "report.png" in result.stdout and "report.md" in result.stdout
    text = (tmp_path / "smoke" / "report.md").read_text()

    records = read_metrics(tmp_path / "smoke")
    windows = [r for r in records if "loss" in r]
    name, goal = task.MAIN_METRIC
    evals = [r for r in records if f"eval_{name}" in r]
    assert len(evals) == 2
    best = (max if goal == "max" else min)(evals, key=lambda e: e[f"eval_{name}"])
    assert f"| best eval {name} | {best[f'eval_{name}']:.4f} at step {best['step']} |" in text
    assert f"| final eval {name} | {evals[-1][f'eval_{name}']:.4f} at step {evals[-1]['step']} |" in text
    assert f"| steps | {windows[-1]['step']} |" in text
    mean_throughput = sum(r["samples_per_s"] for r in windows) / len(windows)
    assert f"| mean throughput | {mean_throughput:,.0f} samples/s |" in text
    summary = next(r["summary"] for r in records if "summary" in r)
    assert f"| wall time | {summary['wall_s']:.1f} s |" in text
    cfg = config.load(SMOKE_CONFIG)  # the run's settings: the tests' run
    assert f"| train.precision | `{cfg.train.precision}` |" in text
    assert f"| data.batch_size | `{cfg.data.batch_size}` |" in text
