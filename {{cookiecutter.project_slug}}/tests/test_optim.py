"""Optimizers and learning-rate schedules by name, the scaling rule for each, warmup, and the
schedules' formulas (each written out here, independently of optim.lr_factor)."""

import math

import pytest
import torch

from {{ cookiecutter.package_name }} import config
from {{ cookiecutter.package_name }}.base import optimizers, schedules
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.loop import optim


@pytest.mark.parametrize(
    ("rule", "global_batch", "expected"),
    [("linear", 256, 8e-3), ("linear", 64, 2e-3), ("sqrt", 256, 1e-3 * math.sqrt(8)), ("none", 256, 1e-3)],
)
def test_scaled_lr(rule, global_batch, expected):
    assert optim.scaled_lr(1e-3, global_batch, 32, rule) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("optimizer", "rule"), [("sgd", "linear"), ("adamw", "sqrt"), ("adafactor", "sqrt"), ("task", "none")]
)
def test_auto_scales_linearly_for_sgd_and_by_the_square_root_for_the_adam_family(optimizer, rule):
    assert optim.scaling_rule("auto", optimizer) == rule
    assert optim.scaling_rule("linear", optimizer) == "linear"  # a rule named is the rule used


@pytest.mark.parametrize(("batch", "share"), [(32, 0.01), (64, 0.02), (128, 0.03), (256, 0.04), (4096, 0.05)])
def test_warmup_share_grows_with_the_batch(batch, share):
    assert optim.warmup_fraction("auto", batch, 32) == pytest.approx(share)
    assert optim.warmup_fraction(0.2, batch, 32) == 0.2


def expected_factor(schedule: str, step: int, total: int, warmup: int, shape: dict) -> float:
    """The lr of step `step` + 1 over the peak, as each schedule is defined with `shape`'s floor,
    wsd's decay share and step's milestones (shares of the steps) and gamma."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    done, floor = (step - warmup) / (total - warmup), shape["min_lr_ratio"]
    decay = round(shape["decay_fraction"] * total)
    return {
        "cosine": floor + (1 - floor) * (1 + math.cos(math.pi * done)) / 2,
        "linear": 1 - (1 - floor) * done,
        "constant": 1.0,
        "wsd": 1.0 if step < total - decay else 1 - (1 - floor) * (step - (total - decay)) / decay,
        "step": shape["gamma"] ** sum(step >= round(share * total) for share in shape["milestones"]),
    }[schedule]


# the defaults (floor 0.1, wsd's last 20%, step's x0.1 at 50% and 75%), then other values of each
SHAPES = [
    {"min_lr_ratio": 0.1, "decay_fraction": 0.2, "milestones": [0.5, 0.75], "gamma": 0.1},
    {"min_lr_ratio": 0.25, "decay_fraction": 0.4, "milestones": [0.3, 0.6, 0.9], "gamma": 0.5},
]


@pytest.mark.parametrize("shape", SHAPES, ids=["defaults", "other-values"])
@pytest.mark.parametrize("schedule", list(schedules.AFTER_WARMUP))
def test_each_schedule_warms_up_then_follows_its_formula(schedule, shape):
    model = torch.nn.Linear(2, 2)
    cfg = config.load(None, [f"schedule.name={schedule}", *(f"schedule.{key}={value}" for key, value in shape.items())])
    optimizer = optim.build_optimizer(model, cfg, lr=1.0)
    scheduler = optim.build_scheduler(optimizer, cfg, total_steps=100, warmup_share=0.05)
    lrs = []
    for _ in range(100):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([expected_factor(schedule, step, 100, 5, shape) for step in range(100)], abs=1e-12)


@pytest.mark.parametrize("total_steps", [3, 100])
def test_a_warmup_fraction_of_0_starts_at_the_peak(total_steps):
    model = torch.nn.Linear(2, 2)
    cfg = config.load(None, ["schedule.name=constant", "schedule.warmup_fraction=0"])
    optimizer = optim.build_optimizer(model, cfg, lr=1.0)
    scheduler = optim.build_scheduler(optimizer, cfg, total_steps=total_steps, warmup_share=0.0)
    lrs = []
    for _ in range(total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == [1.0] * total_steps
    assert optim.warmup_steps(total_steps, 0.001) == 1  # any share above 0 warms up a step at least


def test_norms_and_biases_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decayed, plain = optim.parameter_groups(model, weight_decay=0.1)
    assert [p.ndim for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.1
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0  # bias, norm weight and bias


BUILT = {  # each optimizer of base/optimizers.py: its class and the settings it must get
    "adamw": (torch.optim.AdamW, {"betas": (0.8, 0.95), "fused": True}),
    "sgd": (torch.optim.SGD, {"momentum": 0.5, "nesterov": True, "foreach": True}),
    "adafactor": (getattr(torch.optim, "Adafactor", None), {"foreach": True}),
}


@pytest.mark.parametrize("name", list(optimizers.BUILDERS))
def test_each_optimizer_is_built_with_its_settings_over_the_two_groups(name):
    kind, options = BUILT[name]  # a new optimizer says here what it is built with
    if kind is None:
        pytest.skip(f"torch.optim.Adafactor needs torch>=2.5; this is {torch.__version__}")
    overrides = [f"optim.name={name}", "optim.betas=[0.8, 0.95]", "optim.momentum=0.5", "optim.nesterov=true"]
    cfg = config.load(None, [*overrides, "optim.weight_decay=0.05"])  # not the default 0.01
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    optimizer = optim.build_optimizer(model, cfg, lr=1e-3)
    assert type(optimizer) is kind and [group["weight_decay"] for group in optimizer.param_groups] == [0.05, 0.0]
    assert all(group[key] == value for group in optimizer.param_groups for key, value in options.items())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # the fused or multi-tensor kernel exists in this torch, on this device


@pytest.mark.parametrize("name", list(optimizers.BUILDERS))
def test_each_optimizer_steps_a_parameter_whose_first_gradient_comes_later(name):
    """A routed model's expert that no token chose has no gradient until a later step."""
    if name == "adafactor" and not hasattr(torch.optim, "Adafactor"):
        pytest.skip(f"torch.optim.Adafactor needs torch>=2.5; this is {torch.__version__}")
    cfg = config.load(None, [f"optim.name={name}", "optim.momentum=0.9"])
    model = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    optimizer = optim.build_optimizer(model, cfg, lr=1e-3)
    inputs = torch.randn(2, 4)
    model[0](inputs).sum().backward()
    optimizer.step()
    before = model[1].weight.detach().clone()
    model[1](model[0](inputs)).sum().backward()
    optimizer.step()
    assert not torch.equal(model[1].weight, before)


def test_an_optimizer_or_schedule_of_the_task_must_be_defined_and_adafactor_needs_its_torch(monkeypatch):
    with pytest.raises(ConfigError, match="optim.name: task, but task.py has no build_optimizer; define it"):
        optim.check(config.load(None, ["optim.name=task"]))
    with pytest.raises(ConfigError, match="schedule.name: task, but task.py has no build_scheduler"):
        optim.check(config.load(None, ["schedule.name=task"]))
    monkeypatch.delattr(torch.optim, "Adafactor", raising=False)
    with pytest.raises(ConfigError, match=r"optim.name: adafactor needs torch>=2.5 \(this is .*\); use adamw or sgd"):
        optim.check(config.load(None, ["optim.name=adafactor"]))
    with pytest.raises(ConfigError, match=r"schedule.milestones: \[0.75, 0.5\] is invalid; use increasing shares"):
        config.load(None, ["schedule.milestones=[0.75, 0.5]"])
