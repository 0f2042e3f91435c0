"""The loop's extension points (loop/callbacks.py) and what is built on them: named scalars
(base/scalars.py), EMA weights, the best k checkpoints and early stopping, each in the loop's
own run in this process on the plain stand-in task, and the walkthrough of docs/extending.md
run as a user's callback. A 2-rank resume with each built-in on, ddp and fsdp: the slow tier."""

from __future__ import annotations

import math
import re
import shutil
import sys

import pytest
import torch
from conftest import (
    CHECKPOINT_FORMATS,
    PACKAGE,
    PROJECT,
    SMOKE_CONFIG,
    WORLD_OF_ONE,
    read_metrics,
    torchrun,
    train_args,
)
from helpers import whole_checkpoint

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base import records, scalars
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint
from {{ cookiecutter.package_name }}.loop.callbacks import Callback, Callbacks, resolve
from {{ cookiecutter.package_name }}.loop.ema import EMA
from {{ cookiecutter.package_name }}.tools import export

QUICK = ("run.tensorboard=false", "data.num_workers=0", "train.precision=fp32", "data.batch_size=4")


@pytest.fixture
def run_here(tmp_path, process_settings, plain_task, capsys):
    """`run_here(*overrides)` runs train.run on the smoke config in this process under tmp_path;
    returns (its config, what it printed)."""

    def train_run(*overrides: str, code: int = 0) -> tuple[config.Config, str]:
        cfg = config.load(SMOKE_CONFIG, [f"run.out_dir={tmp_path}", *QUICK, *overrides])
        capsys.readouterr()
        assert train.run(cfg, WORLD_OF_ONE) == code
        return cfg, capsys.readouterr().out

    return train_run


class StepsSeen(Callback):
    """Named scalars of each reduction, from after_step: their values are known exactly."""

    def after_step(self, run):
        scalars.add("steps_in_window", 1.0, reduce="sum")
        scalars.add("last_step", torch.tensor(float(run.state.step)), reduce="max")
        scalars.add("mean_step", float(run.state.step))


def test_named_scalars_reduce_over_the_window_each_by_its_own_rule():
    window = scalars.Window(torch.device("cpu"))
    for value in (1.0, 2.0, 6.0):
        window.add("mean", value, "mean")
        window.add("sum", value, "sum")
        window.add("max", torch.tensor(value), "max")
        window.add("terms", value, "per_term")
    names = window.new_names()
    values = scalars.unpacked(names, window.packed(names, 0, 1).tolist(), world_size=1, terms=4.0)
    assert values == {"mean": 3.0, "sum": 9.0, "max": 6.0, "terms": 9.0 / 4.0}


def test_named_scalars_are_refused_under_the_logs_own_names_and_with_two_reductions():
    window = scalars.Window(torch.device("cpu"))
    with pytest.raises(ValueError, match="the log writes 'loss' itself"):
        window.add("loss", 1.0, "mean")
    window.add("norm", 1.0, "mean")
    with pytest.raises(ValueError, match="it was added with reduce='mean' before"):
        window.add("norm", 1.0, "max")
    with pytest.raises(ValueError, match="use one of mean, sum, max, per_term"):
        window.add("other", 1.0, "median")


def test_a_scalar_added_outside_a_training_window_is_not_counted():
    scalars.add("nowhere", 1.0)  # no log window open: nothing happens, nothing fails
    window = scalars.Window(torch.device("cpu"))
    scalars.open_window(window)
    try:
        with scalars.paused():  # as during an evaluation
            scalars.add("in_eval", 1.0)
        scalars.add("in_training", 1.0)
    finally:
        scalars.open_window(None)
    assert list(window.new_names()) == ["in_training"]


def test_a_callbacks_scalars_reach_every_log_window_and_every_sinks_tags(run_here):
    cfg, out = run_here(f"run.callbacks=[{__name__}:StepsSeen]", "train.max_steps=9", "run.log_every=4")
    windows = records.of_kind(read_metrics(cfg.run_dir), records.TRAIN)
    assert [w["step"] for w in windows] == [4, 8, 9]
    assert [w["steps_in_window"] for w in windows] == [4, 4, 1]
    assert [w["last_step"] for w in windows] == [4, 8, 9]
    assert [w["mean_step"] for w in windows] == [2.5, 6.5, 9.0]
    assert {"train/steps_in_window", "train/last_step", "train/mean_step"} <= set(records.scalars(windows[0]))
    assert "| last_step 4 |" in out  # the console line


def test_a_named_scalar_and_an_ema_metric_reach_tensorboard_under_their_tags(run_here):
    pytest.importorskip("tensorboard", reason="TensorBoard is optional: pip install tensorboard (the viz extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callbacks = f"run.callbacks=[{__name__}:StepsSeen,ema]"
    cfg, _ = run_here(callbacks, "run.tensorboard=true", "train.max_steps=8", "run.log_every=4", "eval.every=4")
    events = EventAccumulator(str(cfg.run_dir.tensorboard))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/last_step")] == [(4, 4.0), (8, 8.0)]
    assert [e.step for e in events.Scalars(f"eval/ema/{task.MAIN_METRIC[0]}")] == [4, 8]


def test_ema_follows_its_formula_from_the_start_step_and_averages_a_tied_weight_once():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied, as a language model's embedding and head
    run = type("Run", (), {"model": model, "state": type("State", (), {"step": 0})()})()
    ema = EMA(decay=0.5, start_step=1)
    ema.setup(run)
    assert ema.names == ["0.weight"]  # the tied weight once
    history = []
    for step in (1, 2, 3):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        run.state.step = step
        ema.after_step(run)
        history.append(ema.shadow[0].clone())
    weights = model[0].weight.detach()
    assert torch.allclose(history[0], weights - 2)  # at the start step: the weights themselves
    assert torch.allclose(history[1], 0.5 * history[0] + 0.5 * (weights - 1))
    assert torch.allclose(history[2], 0.5 * history[1] + 0.5 * weights)


def test_ema_evaluates_the_shadow_weights_and_puts_the_models_back_exactly():
    model = torch.nn.Linear(3, 2)
    run = type("Run", (), {"model": model, "state": type("State", (), {"step": 5})()})()
    ema = EMA(decay=0.9)
    ema.setup(run)
    ema.shadow[0].fill_(7.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for prefix, evaluated in ema.models_to_evaluate(run):
        assert prefix == "ema" and torch.equal(evaluated.weight, torch.full((2, 3), 7.0))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_ema_with_decay_0_evaluates_as_the_model_under_its_prefix(run_here):
    cfg, _ = run_here("run.callbacks=[ema]", "ema.decay=0", "train.max_steps=6", "eval.every=3")
    evaluations = records.of_kind(read_metrics(cfg.run_dir), records.EVAL)
    assert [e["step"] for e in evaluations] == [3, 6]
    for evaluation in evaluations:
        metrics = records.eval_metrics(evaluation)
        assert metrics["ema/loss"] == metrics["loss"]  # an average of one: the weights themselves
    assert "eval/ema/loss" in records.scalars(evaluations[0])


def test_ema_weights_are_checkpointed_and_exported_on_request(run_here, tmp_path):
    cfg, _ = run_here("run.callbacks=[ema]", "ema.decay=0.9", "train.max_steps=6")
    path = cfg.run_dir.checkpoint(6)
    payload = checkpoint.load_file(path)
    shadow = payload["callbacks"]["ema"]["shadow"]
    assert shadow.keys() == parameter_names(cfg)  # the buffers stay the model's
    assert any(not torch.equal(shadow[name], payload["model"][name]) for name in shadow)
    export.main([str(cfg.run_dir), str(tmp_path / "ema.pt"), "--weights", "ema"])
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert exported.keys() == payload["model"].keys()
    assert all(torch.equal(exported[name], shadow[name]) for name in shadow)
    without = payload | {"callbacks": {}}  # a run without the callback
    with pytest.raises(config.ConfigError, match=re.escape("did not have run.callbacks=[ema]")):
        checkpoint.ema_weights(path, without)


def parameter_names(cfg: config.Config) -> set[str]:
    return {name for name, _ in task.build_model(cfg).named_parameters()}


def test_the_best_k_checkpoints_by_the_metric_are_kept_beside_the_newest(run_here):
    settings = ("run.callbacks=[best_checkpoints]", "best_checkpoints.keep=2", "checkpoint.keep_last=1")
    cfg, _ = run_here(*settings, "train.max_steps=12", "eval.every=2", "checkpoint.every_steps=5")
    evaluations = records.of_kind(read_metrics(cfg.run_dir), records.EVAL)
    name, goal = task.MAIN_METRIC
    key = records.EVAL_PREFIX + name
    ranked = sorted(evaluations, key=lambda e: e[key], reverse=goal == "max")[:2]  # ties: the earlier first
    best = cfg.run_dir.checkpoints / "best"
    assert sorted(p.name for p in best.iterdir()) == sorted(f"step_{e['step']:08d}.pt" for e in ranked)
    assert [p.name for p in cfg.run_dir.saved_checkpoints()] == ["step_00000012.pt"]  # keep_last: 1
    for evaluation in ranked:
        saved = checkpoint.load_file(best / f"step_{evaluation['step']:08d}.pt")
        assert saved["step"] == evaluation["step"]
    newest = checkpoint.load_file(cfg.run_dir.checkpoint(12))["callbacks"]["best_checkpoints"]["ranked"]
    assert newest == [[e["step"], e[key]] for e in ranked]


def test_a_resume_from_before_a_best_checkpoint_sets_it_aside(run_here):
    # three evaluations and keep 3: each is among the best
    settings = ("run.callbacks=[best_checkpoints]", "best_checkpoints.keep=3", "eval.every=2")
    settings += ("checkpoint.every_steps=2",)
    cfg, _ = run_here(*settings, "train.max_steps=6")
    best = cfg.run_dir.checkpoints / "best"
    assert sorted(p.name for p in best.iterdir()) == [f"step_{s:08d}.pt" for s in (2, 4, 6)]
    cfg.run_dir.checkpoint(6).unlink()
    cfg.run_dir.checkpoint(4).unlink()  # the run resumes at step 2: best/ got steps 4 and 6 after it
    _, out = run_here(*settings, "train.max_steps=6")
    for step in (4, 6):
        assert f"step_{step:08d}.pt was among the best after the step this run resumed from" in out
        assert (cfg.run_dir.superseded / "best" / f"step_{step:08d}.pt").is_file()
    assert sorted(p.name for p in best.iterdir()) == [f"step_{s:08d}.pt" for s in (2, 4, 6)]  # written anew


def test_early_stopping_ends_the_run_with_its_reason_and_a_requeue_stays_stopped(run_here):
    # min_delta larger than any change: evaluation 1 is the best, 2 and 3 do not better it
    settings = ("run.callbacks=[early_stopping]", "early_stopping.patience=2", "early_stopping.min_delta=1e9")
    cfg, out = run_here(*settings, "eval.every=1", "train.max_steps=10")
    assert [e["step"] for e in records.of_kind(read_metrics(cfg.run_dir), records.EVAL)] == [1, 2, 3]
    summary = records.of_kind(read_metrics(cfg.run_dir), records.SUMMARY)[-1]
    assert summary["step"] == 3 and "in 2 evaluations, at step 3" in summary["summary"]["stopped"]
    assert f"stopped: early stopping: eval {task.MAIN_METRIC[0]} has not bettered" in out
    assert [p.name for p in cfg.run_dir.saved_checkpoints()] == ["step_00000003.pt"]
    logged = len(read_metrics(cfg.run_dir))
    _, again = run_here(*settings, "eval.every=1", "train.max_steps=10")  # a requeue of the stopped run
    assert "this run stopped at step 3 (early stopping:" in again and "nothing to train" in again
    assert len(read_metrics(cfg.run_dir)) == logged


def test_a_stop_at_an_epochs_end_after_that_steps_checkpoint_is_still_in_the_final_checkpoint(run_here):
    # every step saves, and each epoch's evaluation comes after its last step's checkpoint: the
    # stop it decides must reach the checkpoint the run ends with, or a requeue trains on
    settings = ("run.callbacks=[early_stopping]", "early_stopping.patience=1", "early_stopping.min_delta=1e9")
    settings += ("checkpoint.every_steps=1", "train.epochs=4")
    cfg, _ = run_here(*settings)
    evaluations = records.of_kind(read_metrics(cfg.run_dir), records.EVAL)
    assert len(evaluations) == 2  # the epochs' ends: the first is the best, the second stops the run
    _, again = run_here(*settings)
    assert f"this run stopped at step {evaluations[-1]['step']}" in again


def test_early_stopping_with_patience_waits_for_that_many_evaluations_without_a_better_value():
    from {{ cookiecutter.package_name }}.loop.early_stopping import EarlyStopping

    stopping = EarlyStopping("loss", "min", patience=3, min_delta=0.1)
    run = type("Run", (), {"stop": lambda self, reason: stops.append(reason), "state": type("S", (), {"step": 1})})()
    stops = []
    for value in (1.0, 0.95, 0.5, 0.45, 0.41, 0.6):  # better by more than 0.1 only at 0.5
        stopping.after_evaluation(run, {"loss": value})
    assert stopping.best == 0.5 and stopping.since_best == 3 and len(stops) == 1


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_a_killed_run_with_every_built_in_resumes_bit_identical_callback_state_included(run_here, fmt):
    settings = ("run.callbacks=[ema,best_checkpoints,early_stopping]", "early_stopping.patience=100")
    settings += ("train.max_steps=7", "eval.every=2", "checkpoint.every_steps=3", f"checkpoint.format={fmt}")
    cfg, _ = run_here(*settings)
    sharded = fmt == "sharded"
    uninterrupted = whole_checkpoint(cfg.run_dir.checkpoint(7, sharded))
    for path in cfg.run_dir.saved_checkpoints()[-1:]:  # the run killed after step 6's checkpoint
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    _, out = run_here(*settings)
    assert "at step 6" in out
    assert_same(whole_checkpoint(cfg.run_dir.checkpoint(7, sharded)), uninterrupted, keys=CALLBACK_KEYS)


CALLBACK_KEYS = ("model", "optimizer", "callbacks", "step", "scheduler")


def assert_same(ours, theirs, keys=None, where="") -> None:
    """Equal, tensors bit for bit, through nested dicts and lists; `keys`: only these at the top."""
    if isinstance(theirs, dict):
        chosen = keys or theirs.keys()
        assert set(chosen) <= set(ours), where
        for key in chosen:
            assert_same(ours[key], theirs[key], where=f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, where=f"{where}[{index}]")
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs or (isinstance(theirs, float) and math.isnan(theirs) and math.isnan(ours)), where


@pytest.mark.parametrize(
    "names, message",
    [
        (["emma"], "run.callbacks: 'emma' is neither a built-in"),
        (["nowhere:Thing"], "run.callbacks: 'nowhere:Thing': no module"),
        ([f"{__name__}:Missing"], f"{__name__} has no Callback subclass 'Missing'"),
    ],
)
def test_a_callback_name_that_does_not_resolve_is_one_config_error_naming_the_fix(names, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        resolve(names[0])


def test_a_metric_whose_better_direction_is_unknown_asks_for_the_mode():
    cfg = config.load(SMOKE_CONFIG, ["run.callbacks=[early_stopping]", "early_stopping.metric=f1_macro"])
    with pytest.raises(config.ConfigError, match="early_stopping.mode: auto cannot tell whether more f1_macro"):
        Callbacks.from_config(cfg)
    settings = ["run.callbacks=[best_checkpoints]", "best_checkpoints.metric=ema/loss"]
    assert Callbacks.from_config(config.load(SMOKE_CONFIG, settings)).named["best_checkpoints"].goal == "min"


def test_a_metric_the_evaluation_does_not_give_names_those_it_gives(run_here):
    with pytest.raises(config.ConfigError, match="best_checkpoints.metric: the evaluation has no metric 'ema/loss'"):
        run_here("run.callbacks=[best_checkpoints]", "best_checkpoints.metric=ema/loss", "train.max_steps=2")


def test_the_ema_walkthrough_of_the_docs_runs_as_a_users_callback_in_60_lines(run_here, tmp_path, monkeypatch):
    page = (PROJECT / "docs" / "extending.md").read_text()
    walkthrough = page.split("### Walkthrough: EMA weights as a user writes them", 1)[1]
    code = walkthrough.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) <= 60
    # the page's file sits in the package's callbacks/ folder; here it sits in tmp_path, by absolute imports
    (tmp_path / "my_ema.py").write_text(code.replace("from ..", f"from {PACKAGE}."))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_ema", raising=False)
    cfg, _ = run_here("run.callbacks=[my_ema:MyEMA]", "train.max_steps=4", "eval.every=2")
    evaluation = records.of_kind(read_metrics(cfg.run_dir), records.EVAL)[-1]
    assert {"my_ema/loss", "loss"} <= set(records.eval_metrics(evaluation))
    shadow = checkpoint.load_file(cfg.run_dir.checkpoint(4))["callbacks"]["my_ema:MyEMA"]["shadow"]
    assert shadow.keys() == parameter_names(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_2_ranks_with_every_built_in_killed_after_a_checkpoint_resume_bit_identical_and_on_1_rank(tmp_path, strategy):
    if strategy == "fsdp" and checkpoint.sharded_checkpoint.floor_problem():
        pytest.skip(checkpoint.sharded_checkpoint.floor_problem())
    settings = ("data.num_workers=0", "train.max_steps=5", "checkpoint.every_steps=2", "eval.every=2")
    settings += ("run.callbacks=[ema,best_checkpoints,early_stopping]", "early_stopping.patience=100", "ema.decay=0.5")
    settings += (f"parallel.strategy={strategy}", "run.tensorboard=false")
    torchrun(*train_args(tmp_path, *settings), timeout=300)
    run_dir = RunDir(tmp_path / "smoke")
    sharded = strategy == "fsdp"
    uninterrupted = whole_checkpoint(run_dir.checkpoint(5, sharded))
    step_2 = whole_checkpoint(run_dir.checkpoint(2, sharded))
    for later in run_dir.saved_checkpoints()[-2:]:  # killed after step 2's checkpoint: 4 and 5 never written
        shutil.rmtree(later) if later.is_dir() else later.unlink()
    resumed = torchrun(*train_args(tmp_path, *settings), timeout=300)
    assert "at step 2" in resumed.stdout, resumed.stdout
    assert_same(whole_checkpoint(run_dir.checkpoint(5, sharded)), uninterrupted, keys=CALLBACK_KEYS)
    if not sharded:  # a full checkpoint's state on 1 rank: the fast tier's resumes in this process
        return
    # on 1 rank from the 2-rank sharded checkpoint of step 2: the callbacks' state carries on from it
    for later in run_dir.saved_checkpoints()[-2:]:
        shutil.rmtree(later) if later.is_dir() else later.unlink()
    one = torchrun(*train_args(tmp_path, *settings, "train.max_steps=3"), nproc=1, timeout=300)
    assert "at step 2" in one.stdout and "start afresh" not in one.stdout, one.stdout
    step_3 = whole_checkpoint(run_dir.checkpoint(3, sharded))
    shadow_2, shadow_3 = step_2["callbacks"]["ema"]["shadow"], step_3["callbacks"]["ema"]["shadow"]
    for name, average in shadow_3.items():  # had it started afresh, the average would hold the initial weights
        assert torch.allclose(average, 0.5 * shadow_2[name] + 0.5 * step_3["model"][name], atol=1e-6), name
    ranked_2, ranked_3 = (s["callbacks"]["best_checkpoints"]["ranked"] for s in (step_2, step_3))
    assert all(entry in ranked_3 for entry in ranked_2)


@pytest.mark.slow
def test_on_2_ranks_a_scalar_one_rank_adds_and_each_ranks_own_reach_the_log_reduced(tmp_path):
    settings = ("data.num_workers=0", "train.max_steps=8", "run.log_every=4", "run.callbacks=[helpers:RankScalars]")
    torchrun(*train_args(tmp_path, *settings, "run.tensorboard=false"), timeout=300)
    windows = records.of_kind(read_metrics(RunDir(tmp_path / "smoke")), records.TRAIN)
    assert [(w["step"], w["rank_one_steps"], w["highest_rank"], w["mean_rank"]) for w in windows] == [
        (4, 4.0, 1.0, 0.5),
        (8, 4.0, 1.0, 0.5),
    ]
