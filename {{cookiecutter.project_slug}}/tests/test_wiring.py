"""The loop's wiring of each practice, checked on what a real run did.

The helpers have unit tests of their own (test_optim.py, test_dist.py ...); these tests fail
when train.py stops calling them as it should: they run the project's own `train.run` in
this process (a world of one, seconds) and read what it wrote or applied. The wiring that
needs two ranks (set_epoch on every rank, the equal-length check) is in the proofs launch
(test_distributed.py).
"""

import math
import signal

import pytest
import torch
from conftest import SMOKE_CONFIG, TINY, read_metrics
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import Subset

from {{ cookiecutter.package_name }} import checkpoint, config, loaders, preemption, records, task, train
from {{ cookiecutter.package_name }}.checkpoint import TrainState
from {{ cookiecutter.package_name }}.dist import DistInfo

WORLD_OF_ONE = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")


@pytest.fixture
def process_settings(monkeypatch):
    """Put back what train.build and train.run set process-wide: threads, cuDNN, the stop signal."""
    threads, handler = torch.get_num_threads(), signal.getsignal(preemption.WORKER_STOP_SIGNAL)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    yield
    torch.set_num_threads(threads)
    signal.signal(preemption.WORKER_STOP_SIGNAL, handler)


@pytest.fixture
def train_here(tmp_path, process_settings, monkeypatch):
    """`train_here(*overrides)` runs train.run on the smoke config in this process and returns its
    config; batches of 2 and an evaluation set of 8 keep it to seconds whatever the model."""
    keep_first(monkeypatch, eval_samples=8)

    def train_run(*overrides: str) -> config.Config:
        base = [*TINY, f"run.out_dir={tmp_path}", "run.tensorboard=false", "data.num_workers=0", "data.batch_size=2"]
        cfg = config.load(SMOKE_CONFIG, [*base, *overrides])
        assert train.run(cfg, WORLD_OF_ONE) == 0
        return cfg

    return train_run


def keep_first(monkeypatch, train_samples: int | None = None, eval_samples: int | None = None) -> None:
    """Make the task's datasets shorter, through the seam: whole epochs in a few steps."""
    build_datasets = task.build_datasets

    def shorter(cfg):
        train_set, eval_set = build_datasets(cfg)
        train_set = Subset(train_set, range(train_samples or len(train_set)))
        return train_set, Subset(eval_set, range(eval_samples or len(eval_set)))

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


def test_the_loop_warms_up_to_the_batch_scaled_lr_then_decays_to_the_floor(train_here):
    cfg = train_here(
        "train.max_steps=10",
        "run.log_every=1",
        "train.reference_batch_size=8",
        "train.lr_scaling=linear",
        "train.warmup_fraction=0.3",
    )
    peak = cfg.train.lr * 2 / 8  # the linear rule: global batch 2 against the reference 8
    warmup = 3  # 30% of 10 steps
    lrs = logged(cfg, "lr")  # after step s: the learning rate of step s + 1
    rising = [peak * (step + 1) / (warmup + 1) for step in range(1, warmup)]
    assert lrs[:warmup] == pytest.approx([*rising, peak], rel=1e-6)
    assert max(lrs) == pytest.approx(peak, rel=1e-6)
    assert all(later <= earlier for earlier, later in zip(lrs[warmup:-1], lrs[warmup + 1 :], strict=True))
    assert lrs[-1] == pytest.approx(peak * cfg.train.min_lr_ratio, rel=1e-6)


def test_with_accumulation_epochs_and_the_schedule_count_optimizer_steps(train_here, monkeypatch):
    keep_first(monkeypatch, train_samples=24)  # 12 batches of 2: 3 steps of 4 micro-batches
    cfg = train_here("train.grad_accum_steps=4", "train.epochs=2", "train.max_steps=null", "run.log_every=1")
    assert logged(cfg, "step") == [1, 2, 3, 4, 5, 6]
    assert logged(cfg, "epoch") == [0, 0, 0, 1, 1, 1]
    peak = cfg.train.lr * 8 / cfg.train.reference_batch_size  # global batch 2 x 4 micro-batches
    assert logged(cfg, "lr")[-1] == pytest.approx(peak * cfg.train.min_lr_ratio, rel=1e-6)  # the schedule's end


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


def test_the_step_clips_the_true_gradient_when_a_grad_scaler_scales_the_loss():
    # fp16 on CUDA: the loss is scaled by 2**16 before backward; clipping the scaled gradient
    # to train.grad_clip would apply an update 2**16 times too small
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    state = TrainState(
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0),
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12),
    )
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    state.scaler.scale(model(torch.ones(8, 4)).sum()).backward()  # a gradient norm of about 18
    train.optimizer_step(model, state, config.load(SMOKE_CONFIG, ["train.grad_clip=0.01"]))
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


def test_a_nan_loss_stops_the_run_before_a_checkpoint_is_written_from_it(train_here, monkeypatch, tmp_path):
    steps_done, loss_sum, optimizer_step = [], task.loss_sum, train.optimizer_step
    monkeypatch.setattr(train, "optimizer_step", lambda *args: steps_done.append(optimizer_step(*args)))

    def nan_from_step_5(model, batch):
        return loss_sum(model, batch) * (math.nan if len(steps_done) >= 4 else 1)

    monkeypatch.setattr(task, "loss_sum", nan_from_step_5)
    # NaN from step 5; checks at the log steps 3, 6 and the checkpoints 2, 4: it stops at step 6, before its save
    with pytest.raises(FloatingPointError, match="loss is nan or inf between steps 5 and 6"):
        train_here("train.max_steps=10", "run.log_every=3", "checkpoint.every_steps=2")
    written = sorted(path.name for path in (tmp_path / "smoke" / "checkpoints").glob("step_*.pt"))
    assert written == ["step_00000002.pt", "step_00000004.pt"]


def test_evaluation_scores_the_model_in_eval_mode_on_every_sample():
    cfg = config.load(SMOKE_CONFIG, [*TINY, "data.num_workers=0", "train.precision=fp32"])
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
