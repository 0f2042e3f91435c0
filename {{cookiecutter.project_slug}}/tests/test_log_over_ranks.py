"""The training log's window reduced over ranks, in this process: a world of 2 whose ranks each
hold the same window (the reduction of its sums is twice this rank's) must log what one rank saw.
Each figure that is a sum over ranks is divided back by the world size where it is a mean (the
gradient norm, the window's length, a phase's time), and kept where it is a total (samples, loss
terms); a world of one cannot tell the two apart. The same on real ranks: test_train.py's 2-rank
gradient norm (slow tier)."""

import pytest
import torch
from test_metrics import VirtualTime, two_timed_steps

from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import metrics, profiling
from {{ cookiecutter.package_name }}.loop.metrics import TrainingLog
from {{ cookiecutter.package_name }}.loop.profiling import StepClock

WORLD = 2


@pytest.fixture
def same_window_on_every_rank(monkeypatch):
    """A virtual clock, and the log's all-reduce of a world of WORLD ranks that hold this rank's window."""
    virtual = VirtualTime()
    monkeypatch.setattr(metrics, "time", virtual)
    monkeypatch.setattr(profiling, "time", virtual)
    monkeypatch.setattr(metrics, "all_reduce_sum", lambda tensor: tensor * WORLD)
    return virtual


def test_a_window_held_alike_by_every_rank_logs_one_ranks_norm_time_split_and_every_ranks_samples(
    tmp_path, same_window_on_every_rank
):
    virtual = same_window_on_every_rank
    info = DistInfo(0, 0, WORLD, WORLD, torch.device("cpu"), "gloo")
    log = TrainingLog(info, tmp_path / "metrics.jsonl", total_steps=2, first_step=0)
    clock = two_timed_steps(log, StepClock(info.device), virtual)
    record = log.flush(step=2, epoch=0, lr=0.1, seconds=clock.read(), stop_requested=False).record
    assert record["grad_norm"] == 4.0  # the window's mean, not its sum over ranks
    assert record["loss"] == 2.0  # every rank's loss over every rank's terms
    split = {"step_ms": 88, "data_wait_ms": 20, "fwd_bwd_ms": 60, "optimizer_ms": 5, "other_ms": 3}
    assert {name: record[name] for name in split} == pytest.approx(split)  # each rank's 88 ms, not 176
    assert record["samples_per_s"] == pytest.approx(WORLD * 4 / 0.176)  # both ranks' samples in one window's time
    assert record["data_wait_share"] == pytest.approx(20 / 88)
