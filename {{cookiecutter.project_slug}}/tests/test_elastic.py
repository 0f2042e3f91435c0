"""Resume on another world size: the rest of the epoch read exactly once, in the uninterrupted
run's global batches, and the checkpoint's global batch kept (elastic.py, samplers.py)."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROJECT, SMOKE_CONFIG, project_env, run, torchrun, train_args, wait_for
from test_faults import FAULTY, assert_bit_identical, final_state, worker_pid

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.loop import checkpoint, elastic, optim, parallel, samplers
from {{ cookiecutter.package_name }}.loop.state import TrainState

CHUNKS = [list(range(start, min(start + 7, 101))) for start in range(0, 101, 7)]  # 101 records, a short last chunk


def sampler(kind: str, world: int, rank: int, epoch: int = 4):
    if kind == "chunks":
        made = samplers.ChunkOrderSampler(range(101), CHUNKS, num_replicas=world, rank=rank, seed=3)
    else:
        made = samplers.ResumableSampler(range(101), num_replicas=world, rank=rank, seed=3, drop_last=True)
    made.set_epoch(epoch)
    return made


def parts(kind: str, world: int, earlier: list, skip: int = 0) -> list[list[int]]:
    """What each of `world` ranks reads of the epoch after `earlier` layouts, past its first `skip`."""
    ranks = [sampler(kind, world, rank) for rank in range(world)]
    for each in ranks:
        each.resume_at(earlier, skip)
    assert len({len(each) for each in ranks}) == 1 and len(ranks[0]) == len(list(ranks[0]))
    return [list(each) for each in ranks]


@pytest.mark.parametrize("kind", ["shuffle", "chunks"])
@pytest.mark.parametrize("now", [1, 2, 3, 4])
def test_an_epoch_resumed_on_any_world_size_reads_each_sample_once(kind, now):
    before = parts(kind, 2, [])  # 2 ranks read 12 samples each, then the run stops
    read = {index for part in before for index in part[:12]}
    after = [index for part in parts(kind, now, [[2, 12]]) for index in part]
    assert not read & set(after) and len(after) == len(set(after))
    assert len(read) + len(after) > 101 - 2 - now  # all but the last len % world rest
    # and again, from the resumed world to 2 ranks, 5 samples a rank later
    twice = [index for part in parts(kind, 2, [[2, 12], [now, 5]]) for index in part]
    again = {index for part in parts(kind, now, [[2, 12]]) for index in part[:5]}
    assert not (read | again) & set(twice) and len(twice) == len(set(twice))


@pytest.mark.parametrize("kind", ["shuffle", "chunks"])
def test_on_the_same_world_size_a_resume_reads_what_the_uninterrupted_epoch_reads(kind):
    straight = parts(kind, 3, [])
    assert parts(kind, 3, [], skip=8) == [part[8:] for part in straight]  # bit-identical resume


@pytest.mark.parametrize("now, batch", [(1, 12), (3, 4), (4, 3), (6, 2)])
def test_the_global_batches_after_a_resume_on_another_world_size_are_the_uninterrupted_runs(now, batch):
    # DistributedSampler's layout: b batches of B on W ranks read the first b*B*W samples of the order
    straight = parts("shuffle", 2, [])
    resumed = parts("shuffle", now, [[2, 12]])
    for step in range(3):  # global batch 12: 6 per rank on 2 ranks, `batch` per rank on `now`
        uninterrupted = {i for part in straight for i in part[12 + 6 * step : 12 + 6 * (step + 1)]}
        assert {i for part in resumed for i in part[batch * step : batch * (step + 1)]} == uninterrupted


def checkpoint_of(world: int, batch: int, accum: int) -> dict:
    return {"world_size": world, "config": {"data": {"batch_size": batch}, "train": {"grad_accum_steps": accum}}}


@pytest.mark.parametrize(
    "world, expected",
    [(3, (8, 1)), (1, (12, 2)), (4, (6, 1)), (6, (4, 1)), (8, (3, 1)), (24, (1, 1))],
)
def test_another_world_size_keeps_the_global_batch_with_the_largest_batch_that_fits(world, expected):
    cfg = config.load(SMOKE_CONFIG, ["data.batch_size=12"])
    resized, line = elastic.keep_global_batch(cfg, checkpoint_of(2, 12, 1), world)
    assert (resized.data.batch_size, resized.train.grad_accum_steps) == expected
    batch, accum = expected
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    split = f"batch {batch} x {world} x accum {accum}"
    assert line == f"resumed on {ranks} from a 2-rank checkpoint: {split} keeps the global batch 24"


@pytest.mark.parametrize("saved_world, saved_batch, saved_accum", [(2, 10, 1), (4, 6, 2), (3, 7, 1), (1, 12, 3)])
def test_the_global_batch_on_a_new_world_size_is_exact_whatever_data_batch_size_or_one_line_refuses(
    saved_world, saved_batch, saved_accum
):
    wanted, loaded = saved_world * saved_batch * saved_accum, config.load(SMOKE_CONFIG)
    for world in range(1, 9):
        for largest in range(1, 25):
            cfg = dataclasses.replace(loaded, data=dataclasses.replace(loaded.data, batch_size=largest))
            saved = checkpoint_of(saved_world, saved_batch, saved_accum)
            if world == saved_world or wanted % world:  # the same world: as given; no split: one line
                if wanted % world:
                    with pytest.raises(ConfigError, match=f"does not split over {world} ranks: resume on 1, "):
                        elastic.keep_global_batch(cfg, saved, world)
                continue
            resized, _ = elastic.keep_global_batch(cfg, saved, world)
            batch, accum = resized.data.batch_size, resized.train.grad_accum_steps
            assert batch * world * accum == wanted, (world, largest, batch, accum)  # never 18 or 16 for 20
            fitting = [b for b in range(1, largest + 1) if (wanted // world) % b == 0]
            assert batch == max(fitting), (world, largest, batch)  # the largest that fits: fewest micro-batches


def test_the_same_world_size_changes_nothing():
    cfg = config.load(SMOKE_CONFIG, ["data.batch_size=12"])
    assert elastic.keep_global_batch(cfg, checkpoint_of(2, 12, 1), 2) == (cfg, None)


def test_a_global_batch_the_world_cannot_split_is_one_line_naming_the_ways_out():
    cfg = config.load(SMOKE_CONFIG, ["data.batch_size=12"])
    with pytest.raises(ConfigError) as caught:
        elastic.keep_global_batch(cfg, checkpoint_of(2, 12, 1), 5)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("checkpoint.resume: the checkpoint's global batch 24")
    assert "does not split over 5 ranks" in message and "resume on 1, 2, 3, 4, 6, 8, 12, 24 ranks" in message
    assert "checkpoint.allow_new_global_batch=true" in message
    allowed = config.load(SMOKE_CONFIG, ["data.batch_size=12", "checkpoint.allow_new_global_batch=true"])
    resized, line = elastic.keep_global_batch(allowed, checkpoint_of(2, 12, 1), 5)
    assert resized == allowed and "the global batch goes from 24 to 60" in line


def test_the_loaded_schedule_takes_the_peak_lr_of_the_new_global_batch():
    model = torch.nn.Linear(3, 2)
    cfg = config.load(SMOKE_CONFIG)
    optimizer = optim.build_optimizer(model, cfg, 0.1)
    state = TrainState(optimizer, optim.build_scheduler(optimizer, cfg, 100, 0.1), torch.amp.GradScaler("cpu"))
    for _ in range(30):  # past the warmup
        optimizer.step()
        state.scheduler.step()
    before = optimizer.param_groups[0]["lr"]
    elastic.rescale_lr(state, 0.05)
    assert state.scheduler.base_lrs == [0.05, 0.05] and optimizer.param_groups[0]["lr"] == pytest.approx(before / 2)
    state.scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * state.scheduler.lr_lambdas[0](31))


def test_a_tasks_chained_schedule_takes_the_new_peak_lr_in_each_of_its_parts():
    def task_schedule(lr: float):  # warmup then cosine, as a task's build_scheduler may return it
        optimizer = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=lr)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[5])
        return TrainState(optimizer, scheduler, torch.amp.GradScaler("cpu"))

    def lr_after(state: TrainState, steps: int) -> float:
        for _ in range(steps):
            state.optimizer.step()
            state.scheduler.step()
        return state.optimizer.param_groups[0]["lr"]

    loaded, reference = task_schedule(0.1), task_schedule(0.05)
    lr_after(loaded, 3), lr_after(reference, 3)  # into the warmup, as a checkpoint holds it
    elastic.rescale_lr(loaded, 0.05)
    for steps in (1, 4, 10):  # through the milestone and into the cosine
        assert lr_after(loaded, steps) == pytest.approx(lr_after(reference, steps))


def test_a_resume_on_another_world_size_or_batch_closes_the_epochs_layout():
    state = TrainState(None, None, None, batch_in_epoch=3)
    state.continue_epoch_on(checkpoint_of(2, 12, 1), world_size=2, batch_size=12)
    assert (state.batch_in_epoch, state.earlier_layouts) == (3, [])  # the same world: bit-identical
    state.continue_epoch_on(checkpoint_of(2, 12, 1), world_size=3, batch_size=8)
    assert (state.batch_in_epoch, state.earlier_layouts) == (0, [[2, 36]])


def test_on_more_ranks_each_rank_the_checkpoints_world_had_goes_on_with_its_generators_and_each_new_one_gets_its_own():
    before = checkpoint.rng_state()  # this process's generators, put back after
    try:
        saved, continued = [], []
        for seed in (11, 12):  # the 2 ranks that wrote the checkpoint: their generators at the save
            torch.manual_seed(seed)
            saved.append(checkpoint.rng_state())
            continued.append(torch.rand(4))
        draws = []
        for rank in range(4):  # resumed on 4 ranks
            checkpoint.restore_generators(saved, rank, seed=0)
            draws.append(torch.rand(4))
    finally:
        checkpoint.set_rng_state(before)
    assert all(torch.equal(draws[rank], continued[rank]) for rank in (0, 1))
    assert len({tuple(draw.tolist()) for draw in draws}) == 4  # a dropout mask of its own on every rank


# the default classifier's BatchNorm normalises over each rank's batch, which a new world size changes
NO_BATCHNORM = ("model.norm=layer",) if hasattr(config.load(SMOKE_CONFIG).model, "norm") else ()


def recorded_steps(prefix: Path) -> dict[int, set[int]]:
    """{optimizer step: the training-set indices its global batch read} from every rank's record."""
    steps: dict[int, set[int]] = {}
    for path in prefix.parent.glob(f"{prefix.name}-rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], set()).update(record["indices"])
    return steps


# (the strategy, its checkpoints, the fault that gives time for the kill, what the kill waits for):
# ddp's full checkpoints: the kill between step 10's save and step 20's; fsdp's sharded ones written
# in the background: the kill while step 20's write, every part on disk, awaits its publication
# (a kill -9 during an async save). Then the resumes on WORLDS' ranks, on 2 bit-identical
FSDP_FLOOR = parallel.floor_problem()
SHARDED = [pytest.mark.fsdp, pytest.mark.skipif(bool(FSDP_FLOOR), reason=FSDP_FLOOR or "")]  # the project's model
WORLDS = {"ddp-full": (3, 1), "fsdp-sharded-async": (2, 3, 1)}
SLOW_STEPS = {"FAULT": "slow", "FAULT_SECONDS": "0.1"}
DDP = ("parallel.strategy=ddp",)
FSDP = ("parallel.strategy=fsdp", "parallel.activation_checkpointing=selective")
KILLS = {
    "ddp-full": (DDP, (), SLOW_STEPS, "step_00000010.pt"),
    "fsdp-sharded-async": (
        FSDP,
        ("checkpoint.async_save=true",),
        {"FAULT": "slow_publish", "FAULT_STEP": "20", "FAULT_SECONDS": "60"},
        ".step_00000020.partial/.metadata",
    ),
}


def elastic_settings(strategy: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """The drill's settings under `strategy` and its steps: an epoch and 6 steps of the next."""
    per_epoch = len(task.build_datasets(config.load(SMOKE_CONFIG))[0]) // 12  # global batch 12: 6 x 2 ranks
    assert per_epoch > 14, "the kill must land mid-epoch"
    steps = per_epoch + 6
    exact = ("train.precision=fp32", "optim.lr_scaling=none", "data.num_workers=0", "data.batch_size=6", *NO_BATCHNORM)
    checkpoints = ("checkpoint.every_steps=10", "checkpoint.keep_last=20")
    return (*exact, *checkpoints, f"train.max_steps={steps}", *strategy), steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(strategy)`: the directory of the strategy's uninterrupted 2-rank run, which
    recorded its samples; one run per strategy, whatever format its checkpoints (the weights are
    the same)."""
    done = {}

    def get(strategy: tuple[str, ...]) -> Path:
        if strategy not in done:
            out = tmp_path_factory.mktemp("straight")
            launch = [FAULTY, *train_args(out, *elastic_settings(strategy)[0])[2:]]
            torchrun(*launch, env=project_env(RECORD=str(out)), timeout=180)
            done[strategy] = out
        return done[strategy]

    return get


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find a worker's pid")
@pytest.mark.parametrize(
    "kind",
    [
        "ddp-full",
        pytest.param("fsdp-sharded-async", marks=SHARDED),
    ],
)
def test_a_run_killed_mid_epoch_goes_on_on_3_ranks_and_on_1_with_the_uninterrupted_runs_global_batches(
    tmp_path, kind, uninterrupted
):
    strategy, checkpoints, fault, killed_after = KILLS[kind]
    straight_dir = uninterrupted(strategy)
    settings, steps = elastic_settings(strategy)
    settings += checkpoints
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", FAULTY]
    command += train_args(tmp_path / "killed", *settings)[2:]
    job = subprocess.Popen(command, cwd=PROJECT, env=project_env(**fault), text=True)
    try:
        wait_for((tmp_path / "killed" / "smoke" / "checkpoints" / killed_after).exists, timeout=120)
        os.kill(worker_pid(job.pid, rank=1), signal.SIGKILL)  # mid-epoch 0, before step 20's checkpoint is published
        assert job.wait(timeout=60) != 0
    finally:
        job.kill()
    # ddp's resume on 2: test_faults.py (full checkpoints), test_packs.py (sharded ones, and on 1);
    # fsdp's full checkpoints load exactly on other world sizes: test_parallel.py
    for world in WORLDS[kind]:
        shutil.copytree(tmp_path / "killed", tmp_path / f"on{world}")
        resume = [FAULTY, *train_args(tmp_path / f"on{world}", *settings)[2:]]
        env = project_env(RECORD=str(tmp_path / f"on{world}"))
        if world == 1:
            resumed = run([sys.executable, *resume], env=env, timeout=180)
        else:
            resumed = torchrun(*resume, nproc=world, env=env, timeout=180)
        assert "checkpoints/step_00000010" in resumed.stdout and "at step 10" in resumed.stdout
        if kind == "fsdp-sharded-async":
            assert "note: .step_00000020.partial: an incomplete sharded checkpoint" in resumed.stdout
        straight, ours = recorded_steps(straight_dir), recorded_steps(tmp_path / f"on{world}")
        assert sorted(ours) == list(range(11, steps + 1))
        for step in ours:
            assert ours[step] == straight[step], f"on {world} ranks, step {step} read other samples"
        final = [final_state(path / "smoke", steps) for path in (straight_dir, tmp_path / f"on{world}")]
        if world == 2:
            for part in ("model", "optimizer", "scheduler", "step", "epoch"):
                assert_bit_identical(final[1][part], final[0][part], part)
            continue
        batch, accum = (4, 1) if world == 3 else (6, 2)
        kept = f"from a 2-rank checkpoint: batch {batch} x {world} x accum {accum} keeps the global batch 12"
        assert kept in resumed.stdout, resumed.stdout[-2000:]
        if train.has_batchnorm(task.build_model(config.load(SMOKE_CONFIG, list(NO_BATCHNORM)))):
            continue  # statistics of another per-device batch: other weights, as the batch size changed
        weights = [state["model"] for state in final]
        largest = max((weights[0][name] - weights[1][name]).abs().max().item() for name in weights[0])
        assert largest < 1e-5, f"on {world} ranks the weights differ by {largest:.1e}"
