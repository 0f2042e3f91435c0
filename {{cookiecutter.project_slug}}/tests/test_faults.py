"""Fault drills: no lost work, no hangs. Every launch is bounded in time."""

import os
import pickle
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    PROJECT,
    SMOKE_CONFIG,
    newest_checkpoint,
    project_env,
    torchrun,
    train_args,
    wait_for,
)
from helpers import resume, whole_checkpoint

from {{ cookiecutter.package_name }} import config, train
from {{ cookiecutter.package_name }}.base import preemption
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint, optim, sharded_checkpoint
from {{ cookiecutter.package_name }}.loop.state import TrainState
from {{ cookiecutter.package_name }}.task import build_datasets, build_model
from {{ cookiecutter.package_name }}.tools import export, launch

FAULTY = str(PROJECT / "tests" / "faulty_train.py")
EVERY_20 = ("checkpoint.every_steps=20", "checkpoint.keep_last=10")
EVERY_10 = ("checkpoint.every_steps=10", "checkpoint.keep_last=20")


def faulty_run(out_dir, *overrides, launcher=(), timeout=120, **fault):
    return torchrun(
        FAULTY,
        *train_args(out_dir, *EVERY_20, *overrides)[2:],
        launcher=launcher,
        timeout=timeout,
        check=False,
        env=project_env(**fault),
    )


def final_state(run_dir: Path, step: int) -> dict:
    """Step `step`'s checkpoint of the run, whole, in either format."""
    path = RunDir(run_dir).checkpoint(step)
    return whole_checkpoint(path if path.exists() else RunDir(run_dir).checkpoint(step, sharded=True))


def assert_bit_identical(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_bit_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a} != {b}"


@dataclass
class StraightRun:
    overrides: tuple[str, ...]
    steps: int
    state: dict


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> StraightRun:
    """An uninterrupted 2-rank run 5 steps into epoch 1, checkpointing every 10 steps: the
    reference for every resume (a resume at step 10 or 20 is mid-epoch 0 for every task)."""
    cfg = config.load(SMOKE_CONFIG)
    train_set, _ = build_datasets(cfg)
    steps = len(train_set) // 2 // cfg.data.batch_size // cfg.train.grad_accum_steps + 5
    overrides = (*EVERY_10, f"train.max_steps={steps}")
    out = tmp_path_factory.mktemp("straight")
    torchrun(*train_args(out, *overrides), timeout=180)
    return StraightRun(overrides, steps, final_state(out / "smoke", steps))


@pytest.mark.task
def test_resume_mid_epoch_is_bit_identical_to_an_uninterrupted_run(tmp_path, straight_run):
    # rank 1 crashes in step 15 and torchrun restarts the workers (--max-restarts=1), as on a
    # cluster: they auto-resume from step 10's checkpoint as a rerun by hand would
    once = tmp_path / "failed-once"
    result = faulty_run(
        tmp_path,
        *straight_run.overrides,
        launcher=("--max-restarts=1",),
        timeout=240,
        FAULT="crash",
        FAULT_RANK="1",
        FAULT_STEP="15",
        FAULT_ONCE=str(once),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert once.exists() and "injected crash in step 15" in result.stderr, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "step_00000010.pt at step 10" in result.stdout
    final = final_state(tmp_path / "smoke", straight_run.steps)
    for part in ("model", "optimizer", "scheduler", "scaler", "step", "epoch"):
        assert_bit_identical(final[part], straight_run.state[part], part)


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    for pid in launch.children(launcher_pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(
    "saves",
    [
        ("checkpoint.every_steps=1000",),
        ("checkpoint.every_steps=5", "checkpoint.format=sharded", "checkpoint.async_save=true"),
    ],
    ids=["full", "sharded-async"],  # async: the stop's checkpoint waits for the write in flight, then writes its own
)
def test_sigterm_checkpoints_the_current_step_exits_75_and_the_rerun_continues(tmp_path, saves):
    if "checkpoint.format=sharded" in saves and sharded_checkpoint.floor_problem():
        pytest.skip(sharded_checkpoint.floor_problem())
    overrides = [*train_args(tmp_path, "train.epochs=200", *saves)[2:]]
    job = subprocess.Popen(
        ["bash", "scripts/train.sh", *overrides],
        cwd=PROJECT,
        env=project_env(NPROC_PER_NODE="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics = tmp_path / "smoke" / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=60)
        job.send_signal(signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == preemption.PREEMPTED_EXIT_CODE, stderr
    saved = newest_checkpoint(tmp_path / "smoke").name
    step = int(saved.removeprefix("step_").removesuffix(".pt"))
    assert f"preempted at step {step}: checkpoint written" in stdout
    rerun = torchrun(*train_args(tmp_path, f"train.max_steps={step + 5}", *saves), timeout=120)
    assert f"{saved} at step {step}" in rerun.stdout and f"done: {step + 5} steps" in rerun.stdout


@pytest.mark.slow
def test_exception_in_one_ranks_data_pipeline_ends_the_job_with_its_traceback(tmp_path):
    start = time.monotonic()
    result = faulty_run(tmp_path, timeout=90, FAULT="data", FAULT_RANK="1", FAULT_STEP="3")
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "[rank 1/2] ValueError: injected data error" in result.stderr
    assert "Traceback" in result.stderr


@pytest.mark.slow
def test_short_timeout_turns_a_stuck_collective_into_an_error_and_the_stuck_rank_ends_at_once(tmp_path):
    start = time.monotonic()
    result = faulty_run(
        tmp_path,
        "dist.timeout_minutes=0.05",
        timeout=120,
        FAULT="stall",
        FAULT_RANK="1",
        FAULT_STEP="3",
        FAULT_SECONDS="60",
    )
    assert result.returncode != 0
    # rank 0 times out after 3 s; torchrun's SIGTERM then ends rank 1, asleep outside any
    # collective, at once: a rank that trapped SIGTERM would hold the job until the SIGKILL 30 s later
    assert time.monotonic() - start < 25
    # rank 0 gave up waiting: gloo words it "Timed out" or "Application timeout caused pair closure"
    assert "[rank 0/2]" in result.stderr and ("imed out" in result.stderr or "Application timeout" in result.stderr)


def small_run(step: int) -> tuple[torch.nn.Module, TrainState]:
    """A model and its training state at `step`, as checkpoint.save and resume take them."""
    cfg = config.load(SMOKE_CONFIG)
    model = build_model(cfg)
    optimizer = optim.build_optimizer(model, cfg, 1e-3)
    scheduler = optim.build_scheduler(optimizer, cfg, 100, 0.05)
    return model, TrainState(optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), step=step)


INFO = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
SETTINGS = config.to_dict(config.load(SMOKE_CONFIG))  # the run's settings, as resume compares them


def test_a_crash_between_write_and_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path)
    checkpoint.save(*small_run(1), run_dir, SETTINGS, INFO, keep_last=3)

    def crash(src, dst):
        raise OSError("killed during the write")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError, match="killed during the write"):
        checkpoint.save(*small_run(2), run_dir, SETTINGS, INFO, keep_last=3)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoints" / "step_00000002.pt").exists()
    path, state = checkpoint.newest_loadable(run_dir)
    assert path.name == "step_00000001.pt" and state["step"] == 1


def test_corrupt_checkpoints_are_skipped_by_auto_and_rejected_by_path(tmp_path):
    run_dir = RunDir(tmp_path)
    for step in (1, 2):
        checkpoint.save(*small_run(step), run_dir, SETTINGS, INFO, keep_last=5)
    good = (tmp_path / "checkpoints" / "step_00000002.pt").read_bytes()
    (tmp_path / "checkpoints" / "step_00000003.pt").write_bytes(good[: len(good) // 2])  # truncated
    (tmp_path / "checkpoints" / "step_00000004.pt").write_bytes(b"not a checkpoint")  # garbage
    with pytest.warns(UserWarning, match="step_00000004.pt, which is unreadable") as skipped:
        path, state = checkpoint.newest_loadable(run_dir)
    assert not any("checkpoint.resume" in str(warning.message) for warning in skipped)  # auto is what runs
    assert path.name == "step_00000002.pt" and state["step"] == 2
    model, resumed = small_run(0)
    assert resume(model, resumed, run_dir, "auto", INFO, SETTINGS).name == "step_00000002.pt"
    assert resumed.step == 2
    truncated = str(tmp_path / "checkpoints" / "step_00000003.pt")
    with pytest.raises(
        ConfigError, match="checkpoint.resume: checkpoint .*step_00000003.pt is unreadable .* pass another"
    ):
        resume(*small_run(0), run_dir, truncated, INFO, SETTINGS)


def test_weights_with_nan_are_never_written_and_never_resumed_from(tmp_path):
    run_dir = RunDir(tmp_path)
    checkpoint.save(*small_run(1), run_dir, SETTINGS, INFO, keep_last=5)
    broken, state = small_run(2)
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    # one parameter filled with NaN (more names where weights are tied, as in a language model)
    with pytest.raises(FloatingPointError, match="not writing the checkpoint of step 2: [0-9]+ weights hold nan"):
        checkpoint.save(broken, state, run_dir, SETTINGS, INFO, keep_last=5)
    assert [path.name for path in run_dir.saved_checkpoints()] == ["step_00000001.pt"]
    # a file with such weights (copied in by hand, say): auto passes over it, a path to it is refused
    payload = checkpoint.load_file(run_dir.checkpoint(1)) | {"model": broken.state_dict(), "step": 2}
    torch.save(payload, run_dir.checkpoint(2))
    with pytest.warns(UserWarning, match="step_00000002.pt: [0-9]+ of its weights hold nan or inf"):
        assert resume(*small_run(0), run_dir, "auto", INFO, SETTINGS).name == "step_00000001.pt"
    with pytest.raises(ConfigError, match="checkpoint.resume: .*step_00000002.pt: [0-9]+ of its weights hold"):
        resume(*small_run(0), run_dir, str(run_dir.checkpoint(2)), INFO, SETTINGS)


@pytest.mark.usefixtures("process_settings")
def test_an_explicit_bad_checkpoint_fails_the_run_clearly(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    assert train.main(train_args(tmp_path, f"checkpoint.resume={bad}", "data.num_workers=0")[2:]) == 2
    assert f"config error: checkpoint.resume: checkpoint {bad} is unreadable" in capsys.readouterr().err


def test_a_resume_with_changed_settings_names_them(tmp_path, capsys):
    run_dir, train_settings, checkpoint_settings = RunDir(tmp_path), SETTINGS["train"], SETTINGS["checkpoint"]
    lr = {"optim": SETTINGS["optim"] | {"lr": 0.1}}
    written = SETTINGS | lr | {"train": train_settings | {"epochs": 10}}
    checkpoint.save(*small_run(3), run_dir, written, INFO, keep_last=1)
    now = SETTINGS | lr | {"train": train_settings | {"epochs": 1}}
    now["checkpoint"] = checkpoint_settings | {"resume": "step_3.pt"}
    resume(*small_run(0), run_dir, "auto", INFO, now)
    note = capsys.readouterr().out
    assert note.startswith("note: resuming step_00000003.pt with settings changed since it was written: ")
    assert "train.epochs 10 -> 1;" in note and "lr" not in note.split(";")[0] and "checkpoint.resume" not in note
    resume(*small_run(0), run_dir, "auto", INFO, written)
    assert capsys.readouterr().out == ""


def test_resuming_another_models_checkpoint_is_one_config_error_that_names_the_fix(tmp_path):
    payload = checkpoint.load_file(checkpoint.save(*small_run(3), RunDir(tmp_path), SETTINGS, INFO, keep_last=1))
    weights = payload["model"]
    reshaped = next(name for name, tensor in weights.items() if tensor.dim() >= 1)
    weights[reshaped] = torch.zeros(*weights[reshaped].shape, 2)
    missing = next(name for name in weights if name != reshaped)
    del weights[missing]
    weights["extra_head.weight"] = torch.zeros(1)
    other = tmp_path / "other_model.pt"
    torch.save(payload, other)
    model, resumed = small_run(0)
    with pytest.raises(ConfigError) as error:
        resume(model, resumed, RunDir(tmp_path), str(other), INFO, SETTINGS)
    assert str(error.value) == (
        f"checkpoint.resume: {other} holds another model (parameters and buffers: 1 missing, e.g. {missing}, "
        f"1 unexpected, e.g. extra_head.weight, 1 of another shape, e.g. {reshaped}): the model settings "
        "changed since it was written; pass run.name=<a new name> to start a new run, or checkpoint.resume=never "
        "to start afresh"
    )
    assert resumed.step == 0


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_never_runs_code_from_the_file(tmp_path):
    evil, marker = tmp_path / "evil.pt", tmp_path / "code-ran"
    evil.write_bytes(pickle.dumps({"model": RunsCode(marker)}))
    with pytest.raises(ValueError, match="unreadable"):
        checkpoint.load_file(evil)
    assert not marker.exists()


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in range(1, 6):
        checkpoint.save(*small_run(step), RunDir(tmp_path), SETTINGS, INFO, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["step_00000004.pt", "step_00000005.pt"]


def test_export_gives_a_plain_state_dict(tmp_path):
    model, state = small_run(7)
    path = checkpoint.save(model, state, RunDir(tmp_path), SETTINGS, INFO, keep_last=1)
    assert export.main([str(path), str(tmp_path / "weights.pt")]) == 0  # the command, in this process
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    fresh = build_model(config.load(SMOKE_CONFIG))
    fresh.load_state_dict(weights)  # strict: no module./_orig_mod. prefixes
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_rng_state_round_trips(tmp_path):
    checkpoint.set_rng_state(checkpoint.rng_state())
    before = checkpoint.rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.set_rng_state(before)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]
