"""The memory estimate (`diagnose memory`, the start-up line) against what torch really holds, on
this project's own model at the tests' size: the optimizer's state after a step, and the
activations a forward saves for backward, with and without activation checkpointing; the static
figure in its parts; and diagnose's calls of the task in train mode, as the seam's contract says."""

import dataclasses
from contextlib import contextmanager

import pytest
import stand_ins
import torch
import torch.nn.functional as F
from conftest import SMOKE_CONFIG
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from {{ cookiecutter.package_name }} import config, task
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import loaders, optim, parallel
from {{ cookiecutter.package_name }}.tools import diagnose, saved_activations

CPU = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
OPTIMIZERS = [
    ["optim.name=adamw"],
    ["optim.name=sgd"],
    ["optim.name=sgd", "optim.momentum=0"],
    ["optim.name=adafactor"],
]


def first_batch(cfg):
    train_set, eval_set = loaders.datasets(cfg)
    return next(iter(loaders.build_loaders(train_set, eval_set, cfg, CPU, 0)[0]))


def fake_model(cfg):
    """The project's model as diagnose memory builds it: on the meta device, then on fake CPU
    tensors (of the FakeTensorMode the caller enters next)."""
    with torch.device("meta"):
        return task.build_model(cfg)


@contextmanager
def traced_on_fake_tensors():
    """A model or loss whose forward reads its data's values (a routed model's choice of experts) cannot be
    traced on fake tensors: the test is skipped, and diagnose memory says so in one line (exit 2)."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        with pytest.raises(SystemExit) as exit_code:
            diagnose.main(["memory", "--config", SMOKE_CONFIG])
        assert exit_code.value.code == 2
        where = diagnose.seam_line(error)
        pytest.skip(
            f"this project's model or loss_sum reads its data's values ({type(error).__name__}{where}): no estimate"
        )


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors`."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("overrides", OPTIMIZERS, ids=lambda o: " ".join(o))
def test_the_optimizer_state_estimate_is_what_the_optimizer_allocates_at_its_first_step(overrides):
    if "optim.name=adafactor" in overrides and not hasattr(torch.optim, "Adafactor"):
        pytest.skip(f"torch {torch.__version__} has no Adafactor (torch>=2.5)")
    cfg = config.load(SMOKE_CONFIG, overrides)
    torch.manual_seed(0)
    model = task.build_model(cfg)
    optimizer = optim.build_optimizer(model, cfg, 1e-3)
    task.loss_sum(model, task.to_device(first_batch(cfg), torch.device("cpu"))).backward()
    optimizer.step()
    held = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    shapes = [p.shape for p in model.parameters()]
    assert parallel.optimizer_state_bytes(shapes, cfg.optim) == storage_bytes(held)
    weights = sum(p.numel() for p in model.parameters())
    assert parallel.state_bytes(shapes, cfg.optim, 1) == 8 * weights + storage_bytes(held)
    if "optim.momentum=0" in overrides:
        assert not held  # plain SGD keeps nothing


def test_each_rank_holds_its_share_of_every_parameter_and_adafactor_its_factored_statistics():
    adamw = config.load(SMOKE_CONFIG).optim
    assert parallel.state_bytes([torch.Size([10, 3])], adamw, 4) == 3 * 3 * (8 + 8) + 4  # rows 10 -> 3 a rank at most
    adafactor = config.load(SMOKE_CONFIG, ["optim.name=adafactor"]).optim
    # a (4096, 1024) matrix: 4096 row and 1024 column statistics, not 4M second moments
    assert parallel.optimizer_state_bytes([(4096, 1024)], adafactor) == 4 * (4096 + 1024 + 1)
    assert parallel.optimizer_state_bytes([(8, 4096, 1024)], adafactor) == 4 * (8 * 4096 + 8 * 1024 + 1)
    assert parallel.optimizer_state_bytes([(4096, 1024)], config.load(SMOKE_CONFIG, ["optim.name=task"]).optim) is None


def saved_by_forward(model, batch, parameters) -> int:
    """Bytes of the distinct storages autograd saves in one forward of task.loss_sum, parameters aside."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = task.loss_sum(model, batch)
    kept = [t for t in saved if t.untyped_storage()._cdata not in parameters]
    del loss
    return storage_bytes(kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 weights and autocast"])
def test_the_activation_estimate_on_fake_tensors_is_what_a_real_forward_saves_with_and_without_checkpointing(
    dtype, monkeypatch
):
    # the estimator, held on a model of plain torch operations whose loss fake tensors can trace: a kernel of
    # the project's model may save what fake tensors cannot see (a CPU LSTM's workspace), and a loss that
    # multiplies a mean by count_terms reads the labels' values; neither makes the model wrong
    stand_ins.install("plain", monkeypatch)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    cfg = config.load(SMOKE_CONFIG, [f"train.precision={precision}"])
    batch = task.to_device(first_batch(cfg), torch.device("cpu"))
    fake = fake_model(cfg)
    with FakeTensorMode(allow_non_fake_inputs=True):  # as diagnose memory: no memory; the stand-in always traces
        diagnose.on_fake_cpu(fake)
        diagnose.gathered_in(fake, dtype)
        estimate = saved_activations.saved_for_backward(fake, batch, parallel.units(fake), precision)
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = task.build_model(cfg)
        diagnose.gathered_in(model, dtype)  # as FSDP gathers them: BatchNorm's stay fp32
        units = parallel.units(model)
        parallel.checkpoint_activations(units, mode)
        parameters = {p.untyped_storage()._cdata for p in model.parameters()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            measured = saved_by_forward(model, batch, parameters)
        assert estimate.kept_bytes(parallel.recomputed(units, mode)) == pytest.approx(measured, rel=0.1), mode
    assert estimate.activation_bytes([]) == estimate.kept_bytes([])  # nothing recomputed: the forward's end is the peak


def test_diagnose_memory_says_what_fits_under_each_strategy_and_checkpointing_on_a_fake_model():
    cfg = config.load(SMOKE_CONFIG, ["train.precision=fp32"])
    params = sum(p.numel() for p in task.build_model(cfg).parameters())
    batch = task.to_device(first_batch(cfg), torch.device("cpu"))
    fake = fake_model(cfg)
    with traced_on_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):  # weights, activations: no memory
        diagnose.on_fake_cpu(fake)
        rows = {(row[0], row[1]): row[2:] for row in diagnose.memory_rows(cfg, fake, batch, 8)}
        units = parallel.units(fake)
        saved = saved_activations.saved_for_backward(fake, batch, units, "fp32")
    ddp, fsdp = rows["ddp", "none"], rows["fsdp", "full"]  # weights, gradients, optimizer state, activations
    steps = 4 * len(list(fake.parameters()))  # AdamW's step count, one a parameter tensor
    assert ddp[:3] == (4 * params, 4 * params, 8 * params + steps)  # fp32 weights, gradients, AdamW's two moments
    assert sum(fsdp[:3]) < sum(ddp[:3]) and rows["fsdp", "none"][3] == ddp[3] == saved.activation_bytes([])
    # recomputing keeps every unit's inputs: it saves memory on most models, not on every one
    assert fsdp[3] == saved.activation_bytes(parallel.recomputed(units, "full"))
    between = (sum(fsdp) + sum(ddp)) / 2 / 1e9  # one of ddp without checkpointing and fsdp with it fits
    lines = diagnose.memory_estimate(cfg, 8, between).splitlines()
    assert lines[0].startswith(f"{params:,} parameters, {len(units)} FSDP units; optim.name=adamw")
    assert lines[1] == "per device: weights + gradients + optimizer state + activations held for backward = total"
    figures = " + ".join(map(diagnose.gb, ddp)) + f" = {diagnose.gb(sum(ddp))}; "
    assert lines[2].startswith(f"  ddp on 8, checkpointing none      {figures}")
    assert f"fits in {between:g} GB: " in lines[2] and lines[2].endswith("  <- parallel.activation_checkpointing")
    assert lines[-1].startswith("  fsdp on 8, checkpointing full")
    verdicts = [line.split(": ")[-1].split()[0] for line in lines[2:]]
    assert verdicts == ["yes" if sum(row) <= between * 1e9 else "no" for row in rows.values()]
    assert sorted(set(verdicts)) == ["no", "yes"]


@pytest.mark.parametrize(
    "overrides",
    [[], ["train.precision=bf16"], ["parallel.reshard_after_forward=false"], ["optim.name=sgd", "optim.momentum=0"]]
    + [["train.grad_accum_steps=2", "parallel.reduce_every_micro_batch=false"]],
    ids=lambda o: " ".join(o) or "defaults",
)
def test_the_static_figure_is_the_weights_the_gradients_and_the_optimizer_state(overrides):
    """Their sum is what the start-up line prints (parallel.static_memory_bytes) under either strategy."""
    cfg = config.load(SMOKE_CONFIG, overrides)
    model = task.build_model(cfg)
    units, params = parallel.units(model), sum(p.numel() for p in model.parameters())
    shapes = [p.shape for p in model.parameters()]
    for strategy, ranks in (("ddp", 3), ("fsdp", 1), ("fsdp", 3)):
        setting = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy=strategy))
        weights, gradients, state = diagnose.static_parts(model, units, setting, ranks)
        assert weights + gradients + state == parallel.static_memory_bytes(model, units, setting, ranks), strategy
        sharded = strategy == "fsdp" and ranks > 1
        local = [parallel.shard_shape(shape, ranks if sharded else 1) for shape in shapes]
        assert state == (parallel.optimizer_state_bytes(local, cfg.optim) or 0)
        share = 4 * sum(torch.Size(shape).numel() for shape in local)
        whole = sharded and cfg.train.grad_accum_steps > 1 and not cfg.parallel.reduce_every_micro_batch
        assert gradients == share + (4 * params if whole else 0)  # fp32 gradients, whole between micro-batches
        if not sharded:  # fp32 weights, and AMP's low-precision copies
            assert weights == 4 * params * (2 if cfg.train.precision == "bf16" else 1)


class DetectorLike(stand_ins.Keyword):
    """As torchvision's detectors: a dict of losses (summed) in train mode, predictions in eval mode."""

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        logits = super().forward(input_ids=input_ids)["logits"]
        if not self.training:
            return [{"scores": sample} for sample in logits]
        predicted, targets = logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
        return {"tokens": F.cross_entropy(predicted, targets, ignore_index=stand_ins.IGNORE, reduction="sum")}


class DetectorLikeTask(stand_ins.KeywordTask):
    """The seam of DetectorLike: its loss the sum of the loss dict; built in eval mode, as
    from_pretrained returns a model, so that only the caller's mode can make loss_sum work."""

    @staticmethod
    def build_model(cfg) -> torch.nn.Module:
        return DetectorLike().eval()

    @staticmethod
    def loss_sum(model: torch.nn.Module, batch) -> torch.Tensor:
        return sum(model(input_ids=batch["input_ids"], labels=batch["labels"]).values())


def test_diagnose_calls_loss_sum_in_train_mode_on_a_model_that_returns_its_losses_only_there(monkeypatch, capsys):
    monkeypatch.setitem(stand_ins.STAND_INS, "detector_like", DetectorLikeTask)
    stand_ins.install("detector_like", monkeypatch)
    assert diagnose.main(["unused", "--config", SMOKE_CONFIG]) == 0
    assert capsys.readouterr().out.startswith("every parameter gets a gradient")
    assert diagnose.main(["memory", "--config", SMOKE_CONFIG]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("  ddp on 8, checkpointing none")


def test_a_model_that_reads_its_datas_values_gets_one_line_that_blames_no_setting(monkeypatch, capsys):
    stand_ins.install("routed", monkeypatch)  # each token goes to the expert its id picks
    with pytest.raises(SystemExit) as exited:
        diagnose.main(["memory", "--config", SMOKE_CONFIG])
    said = capsys.readouterr().err
    assert exited.value.code == 2 and said.count("\n") == 1 and "config error" not in said
    assert said.startswith("cannot estimate: the model's forward or task.loss_sum reads its data's values (")
    assert "DataDependentOutputException at stand_ins.py:" in said  # the line of the user's code that reads them
