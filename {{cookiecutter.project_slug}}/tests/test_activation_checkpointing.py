"""parallel.activation_checkpointing: a recomputed unit gives the gradients of the forward pass it
replays, dropout included, and the setting takes effect under either strategy (parallel.py,
train.wrap). The 2-rank proofs under ddp and fsdp are in tests/dist_proofs.py."""

import pytest
import torch
from conftest import SMOKE_CONFIG, WORLD_OF_ONE
from dist_proofs import DropoutBlocks
from torch import nn

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base.batching import unwrap
from {{ cookiecutter.package_name }}.loop import loaders, parallel


def gradients(mode: str, dropout_seed: int) -> list[torch.Tensor]:
    """The stand-in's gradients on one batch, its units recomputed as `mode` says."""
    torch.manual_seed(0)
    model = DropoutBlocks()
    units = parallel.default_units(model)
    assert units == list(model.blocks) and parallel.checkpoint_activations(units, mode) == []
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(dropout_seed)  # the masks of this forward pass
    model(inputs).square().sum().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recomputed_unit_with_dropout_gives_the_gradients_of_the_forward_pass_it_replays(mode):
    plain = gradients("none", dropout_seed=7)
    assert any(not torch.equal(a, b) for a, b in zip(gradients("none", 8), plain, strict=True))  # dropout is on
    for recomputed, kept in zip(gradients(mode, dropout_seed=7), plain, strict=True):
        torch.testing.assert_close(recomputed, kept, rtol=0, atol=0)  # the same masks, bit for bit


def saved_for_backward(model: nn.Module, batch) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward pass of the task's loss (a
    recomputed unit keeps none: its forward runs again in backward), as benchmarks/sharded.py counts them."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = task.loss_sum(model, batch)
    loss.backward()
    return sum(saved)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_activation_checkpointing_makes_the_tasks_units_recompute_under_either_strategy(strategy):
    saved, recomputed = {}, {}
    for mode in ("none", "selective", "full"):
        settings = [
            f"parallel.strategy={strategy}",
            f"parallel.activation_checkpointing={mode}",
            "train.precision=fp32",
        ]
        cfg = config.load(SMOKE_CONFIG, [*settings, "data.num_workers=0"])
        torch.manual_seed(0)
        model = train.wrap(task.build_model(cfg), cfg, WORLD_OF_ONE)  # the loop's own wrapping (fsdp: a world of one)
        units = parallel.units(unwrap(model))
        recomputed[mode] = sum(getattr(unit.forward, "func", None) is parallel.checkpoint for unit in units)
        train_loader, _ = loaders.build_loaders(*task.build_datasets(cfg), cfg, WORLD_OF_ONE, 0)
        saved[mode] = saved_for_backward(model, next(iter(train_loader)))
    normed = [any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in unit.modules()) for unit in units]
    if all(normed):
        pytest.skip("every unit of this task's model holds BatchNorm, which keeps its activations: none recomputes")
    assert recomputed["none"] == 0 and recomputed["full"] == normed.count(False) >= recomputed["selective"] > 0
    assert saved["full"] < saved["none"], saved  # the units' activations are not kept: the setting took effect
    if recomputed["selective"]:
        assert saved["full"] <= saved["selective"] < saved["none"], saved
