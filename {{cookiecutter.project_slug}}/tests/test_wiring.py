"""The loop's wiring of each practice, checked on what a real run did.

The helpers have unit tests of their own (test_optim.py, test_dist.py ...); these tests fail
when train.py stops calling them as it should: they run the project's own `train.run` in
this process (a world of one, seconds) and read what it wrote or applied. They train the plain
stand-in task of tests/stand_ins.py: the loop's wiring is the same whatever the model, and a
heavy model would make this matrix of schedules, optimizers and resumes minutes; the project's
own model goes through the seam tests, the proofs and its resume drill (test_faults.py, --task).
The wiring that needs two ranks (set_epoch on every rank, the equal-length check) is in the proofs launch
(test_distributed.py); the seam's contract, whatever the model, in test_seam.py.
"""

import math

import pytest
import torch
from conftest import CHECKPOINT_FORMATS, SMOKE_CONFIG, WORLD_OF_ONE, read_metrics
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import Subset

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base import records, schedules
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint, loaders
from {{ cookiecutter.package_name }}.loop.callbacks import Run
from {{ cookiecutter.package_name }}.loop.profiling import StepClock
from {{ cookiecutter.package_name }}.loop.state import TrainState

pytestmark = pytest.mark.usefixtures("plain_task")  # the loop's own behaviour, whatever the model


@pytest.fixture
def train_here(tmp_path, process_settings, monkeypatch):
    """`train_here(*overrides)` runs train.run on the smoke config in this process and returns its
    config; batches of 2 and an evaluation set of 8 keep it to seconds whatever the model."""
    keep_first(monkeypatch, eval_samples=8)

    def train_run(*overrides: str) -> config.Config:
        base = [f"run.out_dir={tmp_path}", "run.tensorboard=false", "data.num_workers=0", "data.batch_size=2"]
        cfg = config.load(SMOKE_CONFIG, [*base, *overrides])
        assert train.run(cfg, WORLD_OF_ONE) == 0
        return cfg

    return train_run


def keep_first(monkeypatch, train_samples: int | None = None, eval_samples: int | None = None) -> None:
    """Make the task's datasets shorter, through the seam: whole epochs in a few steps."""
    build_datasets = task.build_datasets

    def shorter(cfg):  # at most: a task's eval set may be a few long samples
        train_set, eval_set = build_datasets(cfg)
        train_set = Subset(train_set, range(min(train_samples or len(train_set), len(train_set))))
        return train_set, Subset(eval_set, range(min(eval_samples or len(eval_set), len(eval_set))))

    monkeypatch.setattr(task, "build_datasets", shorter)


def logged(cfg: config.Config, key: str) -> list:
    return [r[key] for r in records.of_kind(read_metrics(cfg.run_dir), records.TRAIN)]


@pytest.mark.usefixtures("process_settings")
def test_run_seed_alone_decides_the_initial_weights():
    def initial_weights(seed: int, earlier_draws: int) -> dict:
        torch.manual_seed(earlier_draws)  # whatever used torch's generator before the build
        return train.build(config.load(SMOKE_CONFIG, [f"run.seed={seed}"]), WORLD_OF_ONE).model.state_dict()

    first, again, other = initial_weights(7, 1), initial_weights(7, 2), initial_weights(8, 1)
    assert all(torch.equal(first[name], again[name]) for name in first)  # seeded before the model is built
    assert not all(torch.equal(first[name], other[name]) for name in first)


def schedule_factor(schedule: str, step: int) -> float:
    """The lr of step `step` + 1 over the peak in SCHEDULED's run of 20 steps: 2 warmup steps,
    then each schedule as defined (floor 0.1; wsd decays over the last 5 steps; step: x0.5 at
    steps 10 and 15)."""
    if step < 2:
        return (step + 1) / 3
    done = (step - 2) / 18
    return {
        "cosine": 0.1 + 0.9 * (1 + math.cos(math.pi * done)) / 2,
        "linear": 1 - 0.9 * done,
        "constant": 1.0,
        "wsd": 1.0 if step < 15 else 1 - 0.9 * (step - 15) / 5,
        "step": 1.0 if step < 10 else 0.5 if step < 15 else 0.25,
    }[schedule]


SCHEDULED = (
    "train.max_steps=20",
    "schedule.warmup_fraction=0.1",
    "schedule.min_lr_ratio=0.1",
    "schedule.decay_fraction=0.25",
    "schedule.milestones=[0.5, 0.75]",
    "schedule.gamma=0.5",
    "optim.reference_batch_size=8",
)


@pytest.mark.parametrize("schedule", list(schedules.AFTER_WARMUP))
def test_at_every_step_the_loop_uses_the_lr_of_its_schedule_from_the_batch_scaled_peak(train_here, schedule):
    cfg = train_here(*SCHEDULED, "run.log_every=1", f"schedule.name={schedule}", "optim.lr_scaling=linear")
    peak = cfg.optim.lr * 2 / 8  # the linear rule: global batch 2 against the reference 8
    lrs = logged(cfg, "lr")  # after step s: the learning rate of step s + 1
    assert lrs == pytest.approx([peak * schedule_factor(schedule, step) for step in range(1, 21)], rel=1e-9)


@pytest.mark.parametrize(
    ("name", "scale"), [("adamw", math.sqrt(2 / 8)), ("sgd", 2 / 8), ("adafactor", math.sqrt(2 / 8))]
)
def test_the_loop_steps_the_named_optimizer_at_the_lr_its_rule_scales(train_here, name, scale):
    if not hasattr(torch.optim, "Adafactor") and name == "adafactor":
        pytest.skip(f"torch.optim.Adafactor needs torch>=2.5; this is {torch.__version__}")
    used = []
    record = register_optimizer_step_pre_hook(lambda optimizer, *_: used.append(optimizer))
    try:
        cfg = train_here(*SCHEDULED, "train.max_steps=3", "schedule.name=constant", f"optim.name={name}")
    finally:
        record.remove()
    assert {type(optimizer).__name__.lower() for optimizer in used} == {name}  # optim.lr_scaling=auto:
    assert used[-1].param_groups[0]["initial_lr"] == pytest.approx(cfg.optim.lr * scale, rel=1e-9)  # its rule


def test_with_accumulation_epochs_and_the_schedule_count_optimizer_steps(train_here, monkeypatch):
    keep_first(monkeypatch, train_samples=24)  # 12 batches of 2: 3 steps of 4 micro-batches
    cfg = train_here("train.grad_accum_steps=4", "train.epochs=2", "train.max_steps=null", "run.log_every=1")
    assert logged(cfg, "step") == [1, 2, 3, 4, 5, 6]
    assert logged(cfg, "epoch") == [0, 0, 0, 1, 1, 1]
    peak = cfg.optim.lr * math.sqrt(8 / cfg.optim.reference_batch_size)  # global batch 2 x 4; adamw: sqrt rule
    assert logged(cfg, "lr")[-1] == pytest.approx(peak * cfg.schedule.min_lr_ratio, rel=1e-6)  # the schedule's end


def test_every_optimizer_step_applies_gradients_clipped_to_grad_clip(train_here):
    norms = []

    def record_norm(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    handle = register_optimizer_step_pre_hook(record_norm)
    try:
        train_here("train.max_steps=5", "train.grad_clip=0.001")  # far below a first step's gradient norm
    finally:
        handle.remove()
    assert norms == pytest.approx([0.001] * 5, rel=1e-3)


def test_the_step_clips_the_true_gradient_when_a_grad_scaler_scales_the_loss(monkeypatch):
    # fp16 on CUDA: the loss is scaled by 2**16 before backward; clipping the scaled gradient
    # to train.grad_clip would apply an update 2**16 times too small
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    state = TrainState(
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0),
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12),
    )
    one = WORLD_OF_ONE
    job = train.Job(
        model=model,
        state=state,
        run=Run(model, state, one, None, 1),
        train_loader=None,
        eval_loader=None,
        total_steps=1,
        global_batch=8,
        clock=StepClock(one.device),
    )
    monkeypatch.setattr(task, "TERMS_PER_SAMPLE", None)  # the loss below: one term, whatever the task's
    monkeypatch.setattr(task, "count_terms", lambda batch: 1)
    monkeypatch.setattr(task, "loss_sum", lambda model, batch: model(batch).sum())
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    cfg = config.load(SMOKE_CONFIG, ["train.grad_clip=0.01", "train.precision=fp32"])
    train.train_step(job, [torch.ones(8, 4)], cfg, one)  # a gradient norm of about 18, scaled by 2**12
    update = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    assert torch.linalg.vector_norm(update).item() == pytest.approx(0.01, rel=1e-4)


def test_a_resumed_run_draws_the_random_numbers_an_uninterrupted_run_draws(train_here, monkeypatch, tmp_path):
    # randomness after the resume point, as dropout has: a random weight on each micro-batch's loss
    loss_sum = task.loss_sum
    monkeypatch.setattr(task, "loss_sum", lambda model, batch: loss_sum(model, batch) * (0.5 + torch.rand(())))
    overrides = ("train.max_steps=8", "checkpoint.every_steps=3", "checkpoint.keep_last=5")
    cfg = train_here(*overrides)
    last = cfg.run_dir.checkpoint(8)
    uninterrupted = checkpoint.load_file(last)
    last.unlink()  # as if the run had been killed after step 6's checkpoint, mid-epoch
    train_here(*overrides)
    resumed = checkpoint.load_file(last)
    for name, weights in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], weights), name


def test_an_optimizer_and_schedule_of_the_task_get_the_groups_the_unscaled_lr_and_the_steps(train_here, monkeypatch):
    built = {}

    def build_optimizer(cfg, param_groups, lr):
        built["groups"], built["lr"] = [group["weight_decay"] for group in param_groups], lr
        return torch.optim.RMSprop(param_groups, lr=lr)

    def build_scheduler(cfg, optimizer, total_steps):
        built["total_steps"] = total_steps
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)

    monkeypatch.setattr(task, "build_optimizer", build_optimizer, raising=False)
    monkeypatch.setattr(task, "build_scheduler", build_scheduler, raising=False)
    used = []
    record = register_optimizer_step_pre_hook(lambda optimizer, *_: used.append(type(optimizer)))
    try:
        cfg = train_here(*SCHEDULED, "train.max_steps=4", "optim.name=task", "schedule.name=task", "run.log_every=1")
    finally:
        record.remove()
    assert used == [torch.optim.RMSprop] * 4 and built == {"groups": [0.01, 0.0], "lr": cfg.optim.lr, "total_steps": 4}
    assert logged(cfg, "lr") == pytest.approx([cfg.optim.lr * 0.5**step for step in range(1, 5)])  # auto: unscaled


@pytest.mark.parametrize(
    ("name", "schedule"),
    [("adamw", "wsd"), ("sgd", "step"), ("adafactor", "linear"), ("sgd", "cosine"), ("adamw", "constant")],
)
def test_a_run_resumed_mid_schedule_is_bit_identical_for_every_optimizer_and_schedule(train_here, name, schedule):
    if not hasattr(torch.optim, "Adafactor") and name == "adafactor":
        pytest.skip(f"torch.optim.Adafactor needs torch>=2.5; this is {torch.__version__}")
    overrides = (*SCHEDULED, f"optim.name={name}", f"schedule.name={schedule}", "train.max_steps=12")
    overrides += ("checkpoint.every_steps=5",)
    cfg = train_here(*overrides, "checkpoint.keep_last=5", "run.log_every=1")
    last = cfg.run_dir.checkpoint(12)
    uninterrupted, lrs = checkpoint.load_file(last), logged(cfg, "lr")
    last.unlink()  # as if the run had been killed after step 10's checkpoint, in the schedule's decay
    train_here(*overrides, "checkpoint.keep_last=5", "run.log_every=1")
    resumed = checkpoint.load_file(last)
    assert_same(resumed["model"], uninterrupted["model"])
    assert_same(resumed["optimizer"]["state"], uninterrupted["optimizer"]["state"])
    assert resumed["scheduler"] == uninterrupted["scheduler"] and logged(cfg, "lr")[-2:] == lrs[-2:]


def assert_same(tree, expected) -> None:
    """Tensors bit for bit, anything else equal, through dicts of either."""
    if isinstance(expected, dict):
        assert tree.keys() == expected.keys()
        for key in expected:
            assert_same(tree[key], expected[key])
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(tree, expected)
    else:
        assert tree == expected


@pytest.mark.parametrize("checkpoint_format", CHECKPOINT_FORMATS)
def test_a_nan_loss_stops_the_run_before_a_checkpoint_is_written_from_it_and_a_rerun_resumes_before_it(
    train_here, monkeypatch, tmp_path, capsys, checkpoint_format
):
    steps_done, loss_sum, train_step = [], task.loss_sum, train.train_step
    monkeypatch.setattr(train, "train_step", lambda *args: steps_done.append(train_step(*args)) or steps_done[-1])

    def nan_from_step_5(model, batch):
        return loss_sum(model, batch) * (math.nan if len(steps_done) >= 4 else 1)

    monkeypatch.setattr(task, "loss_sum", nan_from_step_5)
    settings = ("run.log_every=4", "checkpoint.every_steps=3", f"checkpoint.format={checkpoint_format}")
    # NaN from step 5; checks at the log step 4 and the checkpoints 3, 6: it stops at step 6, before
    # its save, which is not a log step (a loop that checked at log steps only wrote it from NaN weights)
    with pytest.raises(FloatingPointError, match="loss is nan or inf between steps 5 and 6"):
        train_here("train.max_steps=10", *settings)
    checkpoints = tmp_path / "smoke" / "checkpoints"
    suffix = ".pt" if checkpoint_format == "full" else ""
    assert sorted(path.name for path in checkpoints.glob("step_*")) == [f"step_00000003{suffix}"]
    monkeypatch.setattr(task, "loss_sum", loss_sum)  # the rerun, with the cause fixed (a lower lr, say)
    capsys.readouterr()
    train_here("train.max_steps=10", *settings)
    assert f"step_00000003{suffix} at step 3" in capsys.readouterr().out


def test_a_run_started_from_an_older_checkpoint_sets_the_later_ones_aside_from_auto(train_here, tmp_path, capsys):
    train_here("train.max_steps=6", "checkpoint.every_steps=2")
    run_dir = RunDir(tmp_path / "smoke")
    capsys.readouterr()
    train_here("train.max_steps=3", f"checkpoint.resume={run_dir.checkpoint(2)}")  # back to step 2, on another path
    moved = "note: step_00000004.pt, step_00000006.pt: written by an earlier attempt after step 2, where this run"
    assert moved in capsys.readouterr().out
    assert [path.name for path in run_dir.saved_checkpoints()] == ["step_00000002.pt", "step_00000003.pt"]
    assert sorted(path.name for path in run_dir.superseded.iterdir()) == ["step_00000004.pt", "step_00000006.pt"]
    assert checkpoint.choose(run_dir, "auto", WORLD_OF_ONE)[0] == run_dir.checkpoint(3)  # this attempt's, not step 6


def test_evaluation_scores_the_model_in_eval_mode_on_every_sample():
    cfg = config.load(SMOKE_CONFIG, ["data.num_workers=0", "train.precision=fp32"])
    model = task.build_model(cfg)
    train_set, eval_set = task.build_datasets(cfg)
    eval_set = Subset(eval_set, range(min(len(eval_set), 99)))  # not a whole number of batches
    _, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, WORLD_OF_ONE, 0)
    results = train.evaluate(model, eval_loader, cfg, WORLD_OF_ONE)
    model.eval()  # the reference: the same batches in eval mode (BatchNorm's running statistics)
    with torch.no_grad():
        sums = [task.eval_sums(model, batch) for batch in eval_loader]
    totals = {name: sum(s[name].double().sum().item() for s in sums) for name in sums[0]}
    expected = task.metrics(totals | {"samples": len(eval_set)})
    assert results["eval_samples"] == len(eval_set)
    assert {name: results[f"eval_{name}"] for name in expected} == pytest.approx(expected, rel=1e-5)
