"""Evaluation counts every sample exactly once; sums are reduced, not means; the step time is split."""

import json
import math

import pytest
import torch
from conftest import SMOKE_CONFIG, read_metrics
from torch.optim.optimizer import register_optimizer_step_pre_hook

from {{ cookiecutter.package_name }} import config, train
from {{ cookiecutter.package_name }}.base import records
from {{ cookiecutter.package_name }}.base.batching import Throughput
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import evaluation, metrics, profiling
from {{ cookiecutter.package_name }}.loop.evaluation import Totals
from {{ cookiecutter.package_name }}.loop.metrics import TrainingLog
from {{ cookiecutter.package_name }}.loop.profiling import StepClock
from {{ cookiecutter.package_name }}.loop.samplers import EvalBatches


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("size", [509, 512, 5, 0])
def test_evaluation_batches_count_each_sample_once_in_the_same_batches_on_any_world_size(world, size):
    plans = [EvalBatches(size, 16, world, rank).plan for rank in range(world)]
    assert len({len(plan) for plan in plans}) == 1  # as many batches on every rank: a sharded model gathers in each
    counted = [tuple(indices) for plan in plans for indices, repeat in plan if not repeat]
    assert sorted(counted) == [tuple(range(start, min(start + 16, size))) for start in range(0, size, 16)]


@pytest.mark.parametrize("form", ["list", "dict"])
def test_outputs_gathered_from_the_ranks_reach_the_metric_in_dataset_order(monkeypatch, form):
    """Rank r evaluated batches r, r + W, ...: rank 0 joins them so that outputs[i] is sample i's."""
    size, world = 23, 3
    plans = [EvalBatches(size, 4, world, rank).plan for rank in range(world)]
    kept = [  # what each rank's run_over keeps: (first index, the batch's outputs), repeats left out
        [(ids[0], ids if form == "list" else {"index": torch.tensor(ids)}) for ids, repeat in plan if not repeat]
        for plan in plans
    ]
    monkeypatch.setattr(evaluation.dist, "gather_to_main", lambda outputs: kept)  # rank 0's view of the gather
    joined = evaluation.in_dataset_order(kept[0], size, DistInfo(0, 0, world, world, torch.device("cpu"), "gloo"))
    assert (joined if form == "list" else joined["index"].tolist()) == list(range(size))


def test_totals_accumulate_in_float64():
    totals = Totals(torch.device("cpu"))
    for _ in range(1000):
        totals.add(loss=torch.tensor(0.1, dtype=torch.bfloat16), count=1)
    sums = totals.reduced()
    assert totals.sums.dtype == torch.float64 and sums["count"] == 1000
    assert totals.names == ["count", "loss"]  # sorted: every rank reduces the same vector


class RecordingBoard:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.records.append("closed")


class VirtualTime:
    """The step clock's and the log's `time`: seconds pass only in `sleep`, so the split is exact
    whatever the machine's load."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def two_timed_steps(log: TrainingLog, clock: StepClock, virtual: VirtualTime) -> StepClock:
    """Two steps as train_one_epoch times them, on the virtual clock: data 20 ms, forward and
    backward 60, optimizer 5, and 3 outside every phase (the loop's own time); loss sum 4 over
    2 terms, 2 samples, gradient norms 3 and 5. Returns the clock."""
    for grad_norm in (3.0, 5.0):
        with clock.data_wait:
            virtual.sleep(0.02)
        with clock.fwd_bwd:
            virtual.sleep(0.06)
        with clock.optimizer:
            virtual.sleep(0.005)
        log.record(torch.tensor(4.0), terms=2.0, samples=2, grad_norm=torch.tensor(grad_norm))
        virtual.sleep(0.003)
    return clock


def test_each_log_window_splits_the_step_time_and_reaches_every_output(tmp_path, capsys, monkeypatch):
    virtual = VirtualTime()
    monkeypatch.setattr(metrics, "time", virtual)
    monkeypatch.setattr(profiling, "time", virtual)
    info = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
    board = RecordingBoard()
    log = TrainingLog(info, tmp_path / "metrics.jsonl", total_steps=2, first_step=0, board=board)
    clock = two_timed_steps(log, StepClock(info.device), virtual)
    window = log.flush(step=2, epoch=0, lr=0.1, seconds=clock.read(), stop_requested=False)
    record = window.record
    assert record["loss"] == 2.0 and record["start_step"] == 0 and record["kind"] == "train"
    assert record["grad_norm"] == 4.0 and records.scalars(record)["train/grad_norm"] == 4.0  # every sink's tag
    assert window.first_step == 1 and window.losses_finite and not window.stop_requested
    split = {"data_wait_ms": 20, "fwd_bwd_ms": 60, "optimizer_ms": 5, "other_ms": 3, "step_ms": 88}
    assert {name: record[name] for name in split} == pytest.approx(split), record
    assert record["samples_per_s"] == pytest.approx(4 / 0.176)
    assert record["data_wait_share"] == pytest.approx(record["data_wait_ms"] / record["step_ms"])
    line = capsys.readouterr().out
    assert "step 2 | epoch 0 | loss 2.0000 | grad norm 4 | lr 1.00e-01" in line
    assert "data wait 23% | 88.0 ms/step: fwd+bwd 60.0, optimizer 5.0, other 3.0" in line
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert board.records == [written] and "stop" not in written
    log.record(torch.tensor(math.nan), terms=2.0, samples=2)
    virtual.sleep(0.01)
    window = log.flush(step=4, epoch=0, lr=0.1, seconds=clock.read(), stop_requested=True)
    assert window.record["fwd_bwd_ms"] == 0  # the clock restarts each window
    assert "grad_norm" not in window.record  # train.grad_clip=null: no norm computed
    assert window.first_step == 3 and not window.losses_finite and window.stop_requested
    log.close()
    assert board.records[-1] == "closed"


@pytest.mark.parametrize(
    ("first_step", "timed"), [(0, "done: 5 steps in "), (3, "done: 5 steps, 2 of them in this attempt's ")]
)
def test_the_summary_times_the_steps_this_attempt_ran(tmp_path, first_step, timed):
    info = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
    log = TrainingLog(info, tmp_path / "metrics.jsonl", total_steps=5, first_step=first_step)
    assert log.summary(5, ("accuracy", "max"), tmp_path).startswith(timed)
    written = json.loads((tmp_path / "metrics.jsonl").read_text())["summary"]
    assert (written["steps"], written["attempt_steps"]) == (5, 5 - first_step)


def test_throughput_and_mfu_count_every_rank_and_accumulated_sample():
    info = DistInfo(0, 0, 2, 2, torch.device("cpu"), "none")
    log = TrainingLog(
        info, "/dev/null", 1, 0, throughput=Throughput("tokens", 64, 794_880.0), peak=(1e12, "run.peak_tflops")
    )
    speed = log.speed(samples_per_s=100.0)  # over both ranks, micro-batches of accumulation included
    assert speed["tokens_per_s"] == 6400.0
    assert speed["mfu"] == pytest.approx(6400 * 794_880 / (2 * 1e12))  # achieved FLOP/s / the peak of 2 devices
    assert log.speed_text(speed) == "6,400 tokens/s | mfu 0.3%"
    assert "MFU against 1.0 TFLOPS per device (run.peak_tflops)" in log.mfu_note()
    plain = TrainingLog(info, "/dev/null", 1, 0)
    assert plain.speed(100.0) == {"samples_per_s": 100.0} and "no FLOPs estimate" in plain.mfu_note()


@pytest.mark.usefixtures("process_settings")
def test_the_log_records_the_gradient_norm_clipping_found_before_it_clipped(tmp_path):
    norms = []  # what the optimizer is given: the clipped gradients' norm
    hook = register_optimizer_step_pre_hook(lambda optimizer, *_: norms.append(gradient_norm(optimizer)))
    settings = [f"run.out_dir={tmp_path}", "run.tensorboard=false", "data.num_workers=0", "run.log_every=1"]
    try:
        cfg = config.load(SMOKE_CONFIG, [*settings, "train.max_steps=3", "train.grad_clip=1e-3"])
        assert train.run(cfg, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")) == 0
    finally:
        hook.remove()
    logged = [r["grad_norm"] for r in records.of_kind(read_metrics(cfg.run_dir.root), records.TRAIN)]
    assert norms == pytest.approx([1e-3] * 3, rel=1e-3)  # clipped
    assert len(logged) == 3 and min(logged) > 1e-2  # the norms before clipping: a first step's, far above


def gradient_norm(optimizer) -> float:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
