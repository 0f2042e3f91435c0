"""A long run shows where it stands from its first step, and foresees its length: the training
log's progress (a bar on a terminal, else a line whenever the console was quiet), and the smoke
check's notes on a machine without the GPUs the project was planned for."""

import io
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import PACKAGE, PROJECT, SMOKE_CONFIG, kill_session, project_env, torchrun, wait_for

from {{ cookiecutter.package_name }}.base import preemption
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import metrics
from {{ cookiecutter.package_name }}.loop.metrics import TrainingLog, duration_text
from {{ cookiecutter.package_name }}.tools import smoke

RANK_0 = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")


class Clock:
    """Stands in for the time module: a step takes what the test says."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def steps(log: TrainingLog, clock: Clock, count: int, seconds: float) -> None:
    for _ in range(count):
        clock.now += seconds
        log.record(torch.tensor(1.0), terms=1.0, samples=1)


@pytest.fixture
def clock(monkeypatch):
    virtual = Clock()
    monkeypatch.setattr(metrics, "time", virtual)
    return virtual


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0123, "0.012 s"), (4.25, "4.2 s"), (42.4, "42 s"), (185, "3 min 05 s"), (7620, "2 h 07 min")],
)
def test_durations_read_at_a_glance(seconds, text):
    assert duration_text(seconds) == text


def test_slow_steps_print_a_line_each_from_the_first_and_foresee_the_whole(tmp_path, capsys, clock):
    log = TrainingLog(RANK_0, tmp_path / "metrics.jsonl", total_steps=40, first_step=0)
    steps(log, clock, 1, seconds=30)  # the first step carries the start-up
    assert capsys.readouterr().out == "step 1/40: 30 s so far (the first step includes the start-up)\n"
    steps(log, clock, 2, seconds=20)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "step 3/40: 20 s a step, about 12 min 20 s left; the 40 steps take about 13 min 30 s "
        "(evaluations and checkpoints come on top)"
    )
    steps(log, clock, 1, seconds=20)
    assert capsys.readouterr().out == "step 4/40: 20 s a step, about 12 min 00 s left\n"


def test_fast_steps_leave_the_console_to_the_log_lines_which_say_the_time_left(tmp_path, capsys, clock):
    log = TrainingLog(RANK_0, tmp_path / "metrics.jsonl", total_steps=1000, first_step=0)
    steps(log, clock, 20, seconds=0.1)  # 1000 steps of 0.1 s: the estimate is worth a line, once 2 s have passed
    assert capsys.readouterr().out == ""
    steps(log, clock, 5, seconds=0.1)
    assert capsys.readouterr().out == (
        "step 21/1000: 0.1 s a step, about 1 min 38 s left; the 1000 steps take about 1 min 40 s "
        "(evaluations and checkpoints come on top)\n"
    )
    phases = {"data_wait": 0.0, "fwd_bwd": 0.4, "optimizer": 0.1}
    line = log.flush(step=25, epoch=0, lr=0.1, seconds=phases, stop_requested=False).record
    assert capsys.readouterr().out.rstrip().endswith("| 1 min 38 s left") and line["step"] == 25
    short = TrainingLog(RANK_0, tmp_path / "short.jsonl", total_steps=40, first_step=0)
    steps(short, clock, 10, seconds=0.01)  # over before a line could help
    assert capsys.readouterr().out == ""


def test_a_resumed_attempt_counts_its_own_steps(tmp_path, capsys, clock):
    log = TrainingLog(RANK_0, tmp_path / "metrics.jsonl", total_steps=40, first_step=30)
    steps(log, clock, 3, seconds=20)
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("step 33/40: 20 s a step, about 2 min 20 s left; the 10 steps take about 3 min 20 s")
    )


def test_on_a_terminal_the_bar_moves_every_step(tmp_path, capsys, clock, monkeypatch):
    monkeypatch.setattr(metrics.sys, "stderr", Terminal())
    log = TrainingLog(RANK_0, tmp_path / "metrics.jsonl", total_steps=40, first_step=0)
    assert not log.bar.disable
    steps(log, clock, 2, seconds=30)
    assert log.bar.n == 2 and capsys.readouterr().out == ""  # the bar, not lines
    log.close()


def test_only_rank_0_shows_progress(tmp_path, capsys, clock):
    rank_1 = DistInfo(1, 1, 2, 2, torch.device("cpu"), "none")
    log = TrainingLog(rank_1, tmp_path / "metrics.jsonl", total_steps=40, first_step=0)
    steps(log, clock, 3, seconds=30)
    assert capsys.readouterr().out == "" and log.progress.done == 0  # nor times its steps (no CUDA sync)


def smoke_config(**train) -> SimpleNamespace:
    return SimpleNamespace(train=SimpleNamespace(**({"precision": "bf16", "grad_accum_steps": 1} | train)))


def test_without_a_gpu_the_smoke_check_names_the_plan_and_the_quick_check_at_once(monkeypatch):
    monkeypatch.setenv("PLANNED_GPUS_PER_NODE", "8")
    two_cpus = DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo")
    note = smoke.planned_note(smoke_config(), two_cpus, quick=False)
    assert note.startswith("smoke: no GPU here: checking the configured run (planned for 8 GPU(s) a node) on 2 CPU")
    assert "in bf16, which a CPU without bf16 units emulates" in note
    assert note.endswith("The quick check on a CPU: scripts/smoke.sh --config configs/smoke.yaml")
    assert "emulates" not in smoke.planned_note(smoke_config(precision="fp32"), two_cpus, quick=False)
    assert smoke.planned_note(smoke_config(), two_cpus, quick=True) is None  # already the quick check
    on_gpus = DistInfo(0, 0, 2, 2, torch.device("cuda", 0), "nccl")
    assert smoke.planned_note(smoke_config(), on_gpus, quick=False) is None


def test_the_quick_check_is_the_tests_smoke_config_however_it_is_named(monkeypatch, tmp_path):
    monkeypatch.chdir(PROJECT)
    assert smoke.is_quick(["configs/smoke.yaml"]) and smoke.is_quick([SMOKE_CONFIG])
    copy = tmp_path / "smoke.yaml"
    shutil.copy(SMOKE_CONFIG, copy)
    assert not smoke.is_quick(["configs/default.yaml"]) and not smoke.is_quick([str(copy)])


def test_the_smoke_estimate_counts_every_micro_batch_and_offers_the_quick_check_when_long():
    job = SimpleNamespace(total_steps=40)
    line = smoke.estimate_line(20.0, job, smoke_config(grad_accum_steps=2), quick=False)
    assert line.startswith("smoke: one forward and backward took 20 s: the 40 steps take about 26 min 40 s")
    assert line.endswith("; to take the quick check instead: Ctrl-C, then scripts/smoke.sh --config configs/smoke.yaml")
    assert "quick check" not in smoke.estimate_line(20.0, job, smoke_config(), quick=True)
    assert "quick check" not in smoke.estimate_line(0.05, job, smoke_config(), quick=False)  # 2 s: no need


@pytest.mark.usefixtures("world_of_one")
def test_the_gradient_check_times_both_passes_in_the_runs_precision(monkeypatch):
    """The estimate comes from these passes: in fp32 they would misjudge a bf16 run, by 10x where
    a CPU emulates bf16."""
    entered = []
    real_autocast = smoke.hardware.autocast

    def recording_autocast(precision, device):
        entered.append(precision)
        return real_autocast(precision, device)

    monkeypatch.setattr(smoke.hardware, "autocast", recording_autocast)
    monkeypatch.setattr(
        smoke, "task", SimpleNamespace(to_device=lambda batch, device: batch, loss_sum=lambda m, b: m(b).sum())
    )
    digests = iter([["a", "b"], ["c", "c"]])  # two ranks: their own gradients differ, the reduced ones agree
    monkeypatch.setattr(smoke.dist, "all_gather_objects", lambda _: next(digests))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    job = SimpleNamespace(model=model, train_loader=[torch.ones(3, 4)])
    passes = []
    two_ranks = DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo")
    verdict, _ = smoke.check_gradients_reduced(job, smoke_config(), two_ranks, passes)
    assert verdict == "PASS" and entered == ["bf16", "bf16"] and len(passes) == 2


@pytest.mark.slow
def test_a_cpu_smoke_check_says_what_it_runs_before_its_first_step_and_foresees_it(tmp_path):
    mine = tmp_path / "mine.yaml"  # not the quick check: a run of the user's
    shutil.copy(SMOKE_CONFIG, mine)
    env = project_env(PLANNED_GPUS_PER_NODE="8", CUDA_VISIBLE_DEVICES="")
    result = torchrun(
        "-m",
        f"{PACKAGE}.tools.smoke",
        "--config",
        str(mine),
        f"run.out_dir={tmp_path}",
        "train.max_steps=6",
        env=env,
        timeout=300,
    )
    out = result.stdout
    assert out.startswith("smoke: no GPU here: checking the configured run (planned for 8 GPU(s) a node)"), out
    estimate = out.index("smoke: one forward and backward took ")
    assert "the 6 steps take about" in out[estimate:] and estimate < out.index("step 5 |") < out.index("PASS")


def test_a_stop_request_ends_a_smoke_rank_at_once_as_a_preempted_run_reports_it(tmp_path, capsys, monkeypatch):
    """A smoke check has nothing to save: the launcher's stop (a Ctrl-C) ends each rank at once,
    and the marker makes the launcher exit 130 rather than report a failure."""
    marker = tmp_path / "preempted"
    monkeypatch.setenv(preemption.MARKER_ENV, str(marker))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(preemption.signal, "signal", lambda *_: None)  # report_preemption's own: not in this process
    monkeypatch.setattr(smoke.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as stopped:
        smoke.stop_now(preemption.WORKER_STOP_SIGNAL, None)
    assert stopped.value.code == 0 and marker.exists()
    assert capsys.readouterr().out == "smoke: stopped on request before its checks ended; nothing to save\n"


@pytest.mark.slow
def test_ctrl_c_stops_a_smoke_check_under_the_launcher_with_one_line_and_130(tmp_path):
    mine = tmp_path / "mine.yaml"
    shutil.copy(SMOKE_CONFIG, mine)
    out = tmp_path / "out.txt"
    long_run = ["train.epochs=1000", "train.max_steps=100000", f"run.out_dir={tmp_path}"]
    command = [sys.executable, "-m", f"{PACKAGE}.tools.launch", "--standalone", "-m", f"{PACKAGE}.tools.smoke"]
    env = project_env(NPROC_PER_NODE="2", CUDA_VISIBLE_DEVICES="")
    with open(out, "w") as sink:
        launcher = subprocess.Popen(
            [*command, "--config", str(mine), *long_run],
            cwd=PROJECT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "smoke: one forward and backward took" in out.read_text(), timeout=240)
        time.sleep(1)  # into the training steps
        os.kill(launcher.pid, signal.SIGINT)
        assert launcher.wait(timeout=60) == 130, out.read_text()
    finally:
        kill_session(launcher, signal.SIGKILL)
    text = out.read_text()
    assert "smoke: stopped on request before its checks ended; nothing to save" in text, text
    assert "Traceback" not in text and "PASS" not in text, text
