"""Learning-rate scaling from a reference batch, warmup, then decay."""

import math

import pytest
import torch

from {{ cookiecutter.package_name }} import config, optim


@pytest.mark.parametrize(
    ("rule", "global_batch", "expected"),
    [
        ("linear", 256, 8e-3),
        ("linear", 64, 2e-3),
        ("sqrt", 256, 1e-3 * math.sqrt(8)),
        ("none", 256, 1e-3),
        ("auto", 128, 4e-3),  # <= 4x: linear
        ("auto", 64, 2e-3),
        ("auto", 512, 1e-3 * 4 * math.sqrt(4)),  # 16x: sqrt beyond 4x, continuous at 4x
        ("auto", 16, 5e-4),  # smaller than the reference: linear down
    ],
)
def test_scaled_lr(rule, global_batch, expected):
    assert optim.scaled_lr(1e-3, global_batch, 32, rule) == pytest.approx(expected)


def test_auto_rule_is_continuous_at_4x():
    assert optim.scaled_lr(1.0, 128, 32, "auto") == pytest.approx(optim.scaled_lr(1.0, 128.0001, 32, "auto"), rel=1e-4)


@pytest.mark.parametrize(("batch", "share"), [(32, 0.01), (64, 0.02), (128, 0.03), (256, 0.04), (4096, 0.05)])
def test_warmup_share_grows_with_the_batch(batch, share):
    assert optim.warmup_fraction("auto", batch, 32) == pytest.approx(share)
    assert optim.warmup_fraction(0.2, batch, 32) == 0.2


def test_schedule_warms_up_then_decays_to_the_floor():
    model = torch.nn.Linear(2, 2)
    optimizer = optim.build_optimizer(model, lr=1.0, weight_decay=0.1)
    cfg = config.TrainConfig(min_lr_ratio=0.1)
    scheduler = optim.build_scheduler(optimizer, cfg, total_steps=100, warmup_share=0.05)
    lrs = []
    for _ in range(100):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] < 0.2 and all(a < b for a, b in zip(lrs[:5], lrs[1:6], strict=True))  # warmup rises
    assert lrs[5] == pytest.approx(1.0)  # peak after 5% of 100 steps
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:], strict=False))  # then decays
    for step in (20, 50, 80):  # cosine from the peak to the floor over the remaining 95 steps
        assert lrs[step] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * (step - 5) / 95)) / 2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1, abs=1e-3)


def test_norms_and_biases_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decayed, plain = optim.build_optimizer(model, lr=1e-3, weight_decay=0.1).param_groups
    assert [p.ndim for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.1
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0


def test_adamw_runs_fused_on_cpu_and_decays_only_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    optimizer = optim.build_optimizer(model, 1e-3, 0.01)
    assert all(group["fused"] for group in optimizer.param_groups)  # one kernel instead of a loop over tensors
    decayed, plain = optimizer.param_groups
    assert [p.ndim for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.01
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0.0  # bias, norm weight and bias
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # the fused CPU kernel exists in this torch
