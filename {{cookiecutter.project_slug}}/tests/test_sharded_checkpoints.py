"""Sharded checkpoints (checkpoint.format=sharded): every rank's part in a directory published by
a rename, read back whole by the commands or resharded by a resumed run (sharded_checkpoint.py)."""

import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import stand_ins
import torch
from conftest import PROJECT, SMOKE_CONFIG, project_env, read_metrics, torchrun, train_args, wait_for
from helpers import resume
from safetensors.torch import load_file
from test_faults import FAULTY, INFO, SETTINGS, final_state, small_run, worker_pid

from {{ cookiecutter.package_name }} import train
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint, parallel, sharded_checkpoint
from {{ cookiecutter.package_name }}.tools import export, smoke

SHARDED = SETTINGS | {"checkpoint": SETTINGS["checkpoint"] | {"format": "sharded"}}
FLOOR = sharded_checkpoint.floor_problem()
pytestmark = pytest.mark.skipif(bool(FLOOR), reason=FLOOR or "")


def test_below_its_floor_the_sharded_format_is_one_config_error_naming_the_version():
    problem = sharded_checkpoint.floor_problem("2.4.1")
    assert problem == (
        "checkpoint.format: sharded needs torch>=2.8 (this is 2.4.1): pip install 'torch>=2.8', "
        "or use checkpoint.format=full"
    )
    assert sharded_checkpoint.floor_problem("2.8.0") is None and sharded_checkpoint.floor_problem("2.14.1") is None
    assert sharded_checkpoint.read_problem(Path("step_00000010"), "2.6.0") == (
        "step_00000010 is a sharded checkpoint, which torch>=2.8 reads (this is 2.6.0): pip install 'torch>=2.8'"
    )


def trained(step: int):
    """small_run's model and state after one real optimizer step (Adam's moments exist); the
    gradient comes from the weights alone, so any task's model takes it."""
    model, state = small_run(step)
    sum((weight.float() ** 2).sum() for weight in model.parameters()).backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return model, state


def test_a_sharded_checkpoint_is_a_directory_published_whole_and_resumes_exactly(tmp_path):
    run_dir = RunDir(tmp_path)
    model, state = trained(3)
    path = checkpoint.save(model, state, run_dir, SHARDED, INFO, keep_last=2)
    assert path == tmp_path / "checkpoints" / "step_00000003" and sharded_checkpoint.is_checkpoint(path)
    assert not run_dir.partial_checkpoints()
    fresh, resumed = small_run(0)
    assert resume(fresh, resumed, run_dir, "auto", INFO, SHARDED) == path
    assert resumed.step == 3
    for (name, ours), theirs in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    for ours, theirs in zip(state.optimizer.state.values(), resumed.optimizer.state.values(), strict=True):
        assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    _, payload = checkpoint.find(path)  # the commands' way: the whole weights, in one process
    assert all(torch.equal(payload["model"][name], value) for name, value in model.state_dict().items())
    assert payload["config"] == SHARDED and "optimizer" not in payload


def test_a_write_killed_before_its_rename_is_never_loaded_and_the_next_save_clears_it(tmp_path, monkeypatch, capsys):
    run_dir = RunDir(tmp_path)
    checkpoint.save(*trained(1), run_dir, SHARDED, INFO, keep_last=3)

    def killed(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(sharded_checkpoint.os, "replace", killed)
    with pytest.raises(OSError, match="killed before the rename"):
        checkpoint.save(*trained(2), run_dir, SHARDED, INFO, keep_last=3)
    monkeypatch.undo()
    assert [path.name for path in run_dir.partial_checkpoints()] == [".step_00000002.partial"]
    assert [path.name for path in run_dir.saved_checkpoints()] == ["step_00000001"]
    chosen, payload = checkpoint.choose(run_dir, "auto", INFO)
    assert chosen.name == "step_00000001" and payload["step"] == 1
    assert capsys.readouterr().out == (
        "note: .step_00000002.partial: an incomplete sharded checkpoint (a write or a removal cut short); not loaded\n"
    )
    checkpoint.save(*trained(3), run_dir, SHARDED, INFO, keep_last=3)
    assert not run_dir.partial_checkpoints()


def test_keep_last_counts_both_formats_and_nan_weights_are_never_written(tmp_path):
    run_dir = RunDir(tmp_path)
    checkpoint.save(*trained(1), run_dir, SETTINGS, INFO, keep_last=2)  # a full one first: format switched
    for step in (2, 3):
        checkpoint.save(*trained(step), run_dir, SHARDED, INFO, keep_last=2)
    assert [path.name for path in run_dir.saved_checkpoints()] == ["step_00000002", "step_00000003"]
    broken, state = trained(4)
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="not writing the checkpoint of step 4: [0-9]+ weights hold nan"):
        checkpoint.save(broken, state, run_dir, SHARDED, INFO, keep_last=2)
    assert [path.name for path in run_dir.saved_checkpoints()] == ["step_00000002", "step_00000003"]
    assert not run_dir.partial_checkpoints()


NAN_SHARD = str(PROJECT / "tests" / "nan_shard_train.py")
FSDP_FLOOR = parallel.floor_problem()


@pytest.mark.slow
@pytest.mark.fsdp
@pytest.mark.skipif(bool(FSDP_FLOOR), reason=FSDP_FLOOR or "")
def test_a_nan_in_one_ranks_shard_stops_every_rank_before_the_sharded_checkpoint_is_written(tmp_path):
    # under fsdp each rank holds its part of the weights: rank 1's NaN is rank 0's to refuse too,
    # at once, not after the collective timeout of a rank that went on into the save alone
    settings = ("parallel.strategy=fsdp", "checkpoint.format=sharded", "checkpoint.every_steps=2", "train.max_steps=4")
    result = torchrun(NAN_SHARD, *train_args(tmp_path, *settings)[2:], timeout=180, check=False)
    assert result.returncode != 0
    for rank in (0, 1):  # the weight, and any tied to it (an embedding and its head)
        refused = rf"\[rank {rank}/2\] FloatingPointError: not writing the checkpoint of step 2: \d+ weights hold nan"
        assert re.search(refused, result.stderr), result.stderr[-3000:]
    assert not RunDir(tmp_path / "smoke").saved_checkpoints()


def test_another_models_sharded_checkpoint_is_refused_from_its_metadata(tmp_path):
    path = checkpoint.save(*trained(3), RunDir(tmp_path), SHARDED, INFO, keep_last=1)
    other, state = small_run(0)  # the same model with its first weight one row longer
    name, weight = next(iter(other.named_parameters()))
    owner, _, leaf = name.rpartition(".")
    setattr(other.get_submodule(owner), leaf, torch.nn.Parameter(torch.zeros(weight.shape[0] + 1, *weight.shape[1:])))
    refused = rf"holds another model \(parameters and buffers: 1 of another shape, e.g. {re.escape(name)}\)"
    with pytest.raises(ConfigError, match=refused):
        resume(other, state, RunDir(tmp_path), str(path), INFO, SHARDED)


def test_under_fsdp_checkpoints_are_sharded_unless_the_format_is_named(tmp_path):
    fsdp = SETTINGS | {"parallel": SETTINGS["parallel"] | {"strategy": "fsdp"}}
    assert SETTINGS["checkpoint"]["format"] == fsdp["checkpoint"]["format"] == "auto"
    model, state = trained(3)
    sharded = checkpoint.save(model, state, RunDir(tmp_path / "fsdp"), fsdp, INFO, keep_last=1)
    assert sharded.is_dir() and sharded_checkpoint.is_checkpoint(sharded)  # auto under fsdp: every rank its part
    full = checkpoint.save(model, state, RunDir(tmp_path / "ddp"), SETTINGS, INFO, keep_last=1)
    assert full.is_file()  # auto under ddp: one file
    named = fsdp | {"checkpoint": fsdp["checkpoint"] | {"format": "full"}}
    assert checkpoint.save(model, state, RunDir(tmp_path / "named"), named, INFO, keep_last=1).is_file()


def test_async_save_needs_the_sharded_format():
    checkpoint.check(SHARDED | {"checkpoint": SHARDED["checkpoint"] | {"async_save": True}})
    with pytest.raises(ConfigError, match="checkpoint.async_save: .* set checkpoint.format=sharded"):
        checkpoint.check(SETTINGS | {"checkpoint": SETTINGS["checkpoint"] | {"async_save": True}})


def test_the_smoke_check_refuses_checkpoint_settings_the_run_would_refuse(capsys):
    with pytest.raises(SystemExit) as stopped:
        smoke.main(["--config", SMOKE_CONFIG, "checkpoint.format=full", "checkpoint.async_save=true"])
    assert stopped.value.code == 2 and capsys.readouterr().err.count("checkpoint.async_save:") == 1


def test_a_step_written_again_replaces_its_checkpoint(tmp_path):
    # a run resumed from an earlier checkpoint (checkpoint.resume=<path>) reaches the steps it saved before
    run_dir = RunDir(tmp_path)
    checkpoint.save(*trained(3), run_dir, SHARDED, INFO, keep_last=2)
    model, state = trained(3)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    path = checkpoint.save(model, state, run_dir, SHARDED, INFO, keep_last=2)
    assert run_dir.saved_checkpoints() == [path] and not run_dir.partial_checkpoints()
    _, payload = checkpoint.find(path)
    assert all(torch.equal(payload["model"][name], value) for name, value in model.state_dict().items())


def test_a_removal_cut_short_leaves_a_partial_directory_never_a_checkpoint_with_parts_missing(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path)
    checkpoint.save(*trained(1), run_dir, SHARDED, INFO, keep_last=1)
    monkeypatch.setattr(sharded_checkpoint.shutil, "rmtree", lambda path, **kwargs: None)  # killed before it
    checkpoint.save(*trained(2), run_dir, SHARDED, INFO, keep_last=1)
    monkeypatch.undo()
    assert [path.name for path in run_dir.saved_checkpoints()] == ["step_00000002"]
    assert [path.name for path in run_dir.partial_checkpoints()] == [".step_00000001.old.partial"]
    checkpoint.save(*trained(3), run_dir, SHARDED, INFO, keep_last=1)
    assert [path.name for path in run_dir.saved_checkpoints()] == ["step_00000003"]
    assert not run_dir.partial_checkpoints()


def test_a_run_that_fails_with_a_write_in_flight_publishes_it_before_it_exits(tmp_path, monkeypatch, process_settings):
    stand_ins.install("plain", monkeypatch)  # the loop's writes, the same whatever the model

    def slow_publish(partial, final, run_dir, keep_last, original=sharded_checkpoint.publish):
        time.sleep(1)  # step 4's write still in flight when step 5 fails
        original(partial, final, run_dir, keep_last)

    def failing_step(job, *args, original=train.train_step):
        if job.state.step == 4:
            raise RuntimeError("injected failure in step 5")
        return original(job, *args)

    monkeypatch.setattr(sharded_checkpoint, "publish", slow_publish)
    monkeypatch.setattr(train, "train_step", failing_step)
    overrides = ["checkpoint.format=sharded", "checkpoint.async_save=true", "checkpoint.every_steps=4"]
    overrides += [f"run.out_dir={tmp_path}", "data.num_workers=0", "run.tensorboard=false"]
    assert train.main(["--config", SMOKE_CONFIG, *overrides]) == 1
    assert [path.name for path in RunDir(tmp_path / "smoke").saved_checkpoints()] == ["step_00000004"]


@contextmanager
def disk_full_for(step: int, writers: list):
    """DCP's file system storage, whose writes into step `step`'s checkpoint fail as on a full disk;
    `writers` gets, for each, whether it ran on the main thread."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    create_stream = FileSystem.create_stream

    @contextmanager
    def full_disk(self, path, mode):
        if f".step_{step:08d}.partial" in str(path) and "w" in mode:
            writers.append(threading.current_thread() is threading.main_thread())
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with create_stream(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = full_disk
    try:
        yield
    finally:
        FileSystem.create_stream = create_stream


@pytest.mark.parametrize("failed, steps", [(2, 6), (4, 5)], ids=["at-the-next-save", "at-the-runs-end"])
def test_a_background_write_that_fails_stops_the_run_and_nothing_after_it_is_published(
    tmp_path, capsys, monkeypatch, process_settings, failed, steps
):
    stand_ins.install("plain", monkeypatch)  # the loop's writes, the same whatever the model
    # checkpoints every 2 steps, written in the background; step `failed`'s write meets a full disk.
    # The run goes on training while it writes, and the next save (step 4's, or the run's final one
    # at step 5) waits for it first: the run fails there, before writing anything after the gap
    overrides = ["checkpoint.format=sharded", "checkpoint.async_save=true", "checkpoint.every_steps=2"]
    overrides += [f"train.max_steps={steps}", "run.log_every=1", f"run.out_dir={tmp_path}"]
    overrides += ["data.num_workers=0", "run.tensorboard=false", "train.precision=fp32"]
    writers = []
    with disk_full_for(failed, writers):
        assert train.main(["--config", SMOKE_CONFIG, *overrides]) == 1
    error = capsys.readouterr().err
    message = f"[rank 0/1] RuntimeError: the background write of checkpoint step_{failed:08d} failed"
    (line,) = [line for line in error.splitlines() if line.startswith(message)]
    assert f"{message} (on rank 0: OSError: [Errno 28] No space left on device: " in line  # the cause's words
    assert line.endswith("check the disk (space, permissions)")
    assert writers == [False]  # written behind the loop, off its thread: checkpoint.async_save took effect
    run_dir = RunDir(tmp_path / "smoke")
    published = [path.name for path in run_dir.saved_checkpoints()]
    assert published == [f"step_{step:08d}" for step in range(2, failed, 2)]  # none from the failed one on
    trained = [record["step"] for record in read_metrics(run_dir.root) if "loss" in record]
    assert trained[-1] == min(failed + 2, steps)  # it stopped at the save after the failed write


def test_export_of_a_sharded_checkpoint_equals_that_of_the_full_one(tmp_path):
    model, state = trained(5)
    exported = []
    for name, settings in (("full", SETTINGS), ("sharded", SHARDED)):
        path = checkpoint.save(model, state, RunDir(tmp_path / name), settings, INFO, keep_last=1)
        out = tmp_path / f"{name}.safetensors"
        export.export_weights(path, out)
        exported.append(load_file(out))
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][name], exported[1][name]) for name in exported[0])
    export.export_weights(path, tmp_path / "bf16.safetensors", dtype="bf16")  # for inference, half the bytes
    halved = load_file(tmp_path / "bf16.safetensors")
    for name, tensor in exported[1].items():
        assert halved[name].dtype == (torch.bfloat16 if tensor.is_floating_point() else tensor.dtype)
        assert torch.equal(halved[name], tensor.to(halved[name].dtype))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find a worker's pid")
def test_a_rank_killed_in_the_middle_of_a_sharded_save_leaves_the_previous_checkpoint_to_resume(tmp_path):
    # the same kill during an asynchronous save: test_elastic.py's fsdp-sharded-async run
    settings = ("checkpoint.format=sharded", "checkpoint.every_steps=10")
    settings += ("checkpoint.keep_last=5", "train.max_steps=30")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", FAULTY]
    command += train_args(tmp_path, *settings)[2:]
    env = project_env(FAULT="slow_publish", FAULT_STEP="20", FAULT_SECONDS="60")
    job = subprocess.Popen(command, cwd=PROJECT, env=env, text=True)
    partial = tmp_path / "smoke" / "checkpoints" / ".step_00000020.partial"
    try:
        wait_for((partial / ".metadata").exists, timeout=120)  # every part written, not yet published
        os.kill(worker_pid(job.pid, rank=0), signal.SIGKILL)
        assert job.wait(timeout=60) != 0
    finally:
        job.kill()
    resumed = torchrun(*train_args(tmp_path, *settings), timeout=180)
    note = "note: .step_00000020.partial: an incomplete sharded checkpoint (a write or a removal cut short); not loaded"
    assert note in resumed.stdout
    assert "resumed from" in resumed.stdout and "step_00000010 at step 10" in resumed.stdout
    assert not partial.exists() and final_state(tmp_path / "smoke", 30)["step"] == 30
