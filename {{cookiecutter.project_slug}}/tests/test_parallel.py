"""parallel.strategy=fsdp and activation checkpointing: the units, the rules that keep FSDP correct,
the memory estimate, and checkpoints that resume under either strategy on any world size.
The sharded loop's maths is proven in tests/dist_proofs.py (test_distributed.py)."""

import json
import math
import sys

import pytest
import torch
from conftest import PROJECT, SMOKE_CONFIG, WORLD_OF_ONE, project_env, read_metrics, run, torchrun, train_args
from helpers import model_with_unused_head
from test_faults import assert_bit_identical, final_state
from test_launchers import smoke_rows
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from {{ cookiecutter.package_name }} import config, task
from {{ cookiecutter.package_name }}.base import records
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.loop import checkpoint, loaders, parallel

PROOFS = str(PROJECT / "tests" / "dist_proofs.py")
needs_fsdp = pytest.mark.skipif(bool(parallel.floor_problem()), reason=parallel.floor_problem() or "")


class TiedLanguageModel(nn.Module):
    """Blocks in a ModuleList, and an embedding whose weight the head shares."""

    def __init__(self, width: int = 8, vocabulary: int = 11, layers: int = 3):
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers))
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens):
        hidden = self.tokens(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden)


@pytest.fixture(autouse=True)
def units_of_their_own(monkeypatch):
    """The tests here shard models of their own: the project's task.shard_units, written for the
    project's model, is never handed one of them (the units come from default_units, or from the
    test's own shard_units)."""
    monkeypatch.delattr(task, "shard_units", raising=False)


def smoke_config(*overrides: str):
    return config.load(SMOKE_CONFIG, list(overrides))


def test_ddps_error_for_a_parameter_without_a_gradient_names_the_setting_and_the_command(world_of_one):
    cfg = config.load(SMOKE_CONFIG, ["data.num_workers=0"])
    model = DistributedDataParallel(model_with_unused_head(cfg))  # parallel.find_unused_parameters=false
    batch = next(iter(loaders.build_loaders(*loaders.datasets(cfg), cfg, WORLD_OF_ONE, 0)[0]))
    finished = pytest.raises(RuntimeError, match="Expected to have finished reduction")
    with finished as raised, parallel.unreduced_parameters_named():
        for _ in range(2):  # DDP finds the missing gradient at the next step's forward
            task.loss_sum(model, batch).backward()
    (note,) = raised.value.__notes__
    assert "set parallel.find_unused_parameters=true" in note and ".tools.diagnose unused` lists them" in note


def test_the_default_units_are_the_blocks_of_the_largest_module_list():
    model = TiedLanguageModel(width=16)
    assert parallel.default_units(model) == list(model.blocks)  # the embedding and the head: the root's


def test_a_child_that_shares_a_weight_with_another_stays_in_the_root():
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 4), nn.Linear(4, 11, bias=False))
    model[2].weight = model[0].weight
    assert parallel.default_units(model) == [model[1]]


def test_without_a_module_list_the_units_are_the_children_that_hold_parameters():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    assert parallel.default_units(model) == [model[0], model[1], model[3]]


def test_units_that_split_tied_weights_or_nest_are_refused_with_the_fix():
    model = TiedLanguageModel()
    problem = parallel.split_parameter(model, [model.head])
    assert problem.startswith("sharding units: head.weight in unit head is tied to tokens.weight outside it")
    assert "one unit" in problem
    assert parallel.split_parameter(model, [model.tokens, model.head]) is not None  # two units, one tensor
    assert "blocks.0 and blocks.0.0 overlap" in parallel.split_parameter(model, [model.blocks[0][0], model.blocks[0]])
    assert "overlap" in parallel.split_parameter(model, [model.blocks[0], model.blocks[0]])
    assert "not a module of the model" in parallel.split_parameter(model, [nn.Linear(2, 2)])
    assert parallel.split_parameter(model, list(model.blocks)) is None


def test_a_seam_naming_units_that_split_tied_weights_is_a_config_error(monkeypatch):
    model = TiedLanguageModel()
    monkeypatch.setattr(task, "shard_units", lambda m: [m.head, *m.blocks], raising=False)  # the user's seam
    with pytest.raises(ConfigError, match="head.weight in unit head is tied to tokens.weight"):
        parallel.units(model)


def test_activation_checkpointing_recomputes_the_units_asked_for_and_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = TiedLanguageModel()
    tokens = torch.randint(0, 11, (4, 5))
    for mode, recomputed in (("full", 3), ("selective", 2), ("none", 0)):
        model = TiedLanguageModel()
        model.load_state_dict(plain.state_dict())
        units = parallel.default_units(model)
        assert parallel.checkpoint_activations(units, mode) == []
        assert sum(getattr(unit.forward, "func", None) is parallel.checkpoint for unit in units) == recomputed
        model(tokens).sum().backward()
        plain.zero_grad()
        plain(tokens).sum().backward()
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
        assert model.state_dict().keys() == plain.state_dict().keys()  # no wrapper in the names


def test_activation_checkpointing_leaves_batchnorm_units_alone():
    # a recomputed forward would update the running statistics a second time
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    units = parallel.default_units(model)
    assert parallel.checkpoint_activations(units, "full") == [model[1]]
    model(torch.randn(6, 4)).sum().backward()
    assert model[1].num_batches_tracked.item() == 1


def test_the_memory_estimate_shares_the_state_over_the_ranks_and_adds_the_gathered_units():
    model = TiedLanguageModel(width=16, vocabulary=50)
    units = parallel.default_units(model)
    shapes = [p.shape for p in model.parameters()]
    params, tensors = sum(p.numel() for p in model.parameters()), len(shapes)
    largest = sum(p.numel() for p in model.blocks[0].parameters())
    ddp = smoke_config("train.precision=fp32")
    assert parallel.static_memory_bytes(model, units, ddp, 8) == 16 * params + 4 * tensors  # AdamW's step counts
    shared = parallel.state_bytes(shapes, ddp.optim, 8)  # each parameter's first dimension split over 8
    assert 16 * params // 8 <= shared <= 16 * params // 8 + 16 * sum(math.prod(s[1:]) for s in shapes) + 4 * tensors
    fsdp = smoke_config("parallel.strategy=fsdp", "train.precision=bf16")
    assert parallel.static_memory_bytes(model, units, fsdp, 8) == shared + 2 * largest * 2
    kept = smoke_config("parallel.strategy=fsdp", "train.precision=fp32", "parallel.reshard_after_forward=false")
    assert parallel.static_memory_bytes(model, units, kept, 8) == shared + 3 * largest * 4
    whole = smoke_config("parallel.strategy=fsdp", "train.precision=fp32", "train.grad_accum_steps=2")
    assert parallel.static_memory_bytes(model, units, whole, 8) == shared + 2 * largest * 4
    whole = smoke_config(
        "parallel.strategy=fsdp",
        "train.precision=fp32",
        "train.grad_accum_steps=2",
        "parallel.reduce_every_micro_batch=false",
    )
    assert parallel.static_memory_bytes(model, units, whole, 8) == shared + 2 * largest * 4 + 4 * params
    assert "whole gradients between micro-batches" in parallel.gathered(whole.parallel, whole.train.grad_accum_steps)
    sgd = smoke_config("train.precision=fp32", "optim.name=sgd", "optim.momentum=0")
    assert parallel.static_memory_bytes(model, units, sgd, 8) == 8 * params  # no optimizer state at all


def test_fsdp_below_its_torch_floor_is_one_line_naming_the_version():
    problem = parallel.floor_problem("2.7.1+cu126")
    assert (
        "parallel.strategy: fsdp needs torch>=2.8 (this is 2.7.1+cu126)" in problem
        and "parallel.strategy=ddp" in problem
    )
    assert parallel.floor_problem("2.8.0") is None and parallel.floor_problem("2.14.1") is None


@needs_fsdp
def test_fsdp_refuses_fp16_and_cpu_offload_without_a_gpu_naming_the_fix():
    with pytest.raises(ConfigError, match="use bf16"):
        parallel.check(smoke_config("parallel.strategy=fsdp", "train.precision=fp16"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="parallel.cpu_offload"):
        parallel.check(smoke_config("parallel.strategy=fsdp", "parallel.cpu_offload=true"), torch.device("cpu"))
    parallel.check(smoke_config("train.precision=fp16"), torch.device("cpu"))  # ddp: GradScaler sees it all


@pytest.mark.skipif(not parallel.floor_problem(), reason=f"torch {torch.__version__} shards; the floor run checks this")
def test_fsdp_on_this_torch_exits_2_with_one_line_before_anything_starts(tmp_path):
    result = torchrun(*train_args(tmp_path, "parallel.strategy=fsdp"), timeout=120, check=False)
    assert result.returncode != 0 and not (tmp_path / "smoke").exists()
    lines = [line for line in result.stderr.splitlines() if line.startswith("config error")]
    assert lines and all("fsdp needs torch>=2.8" in line for line in lines)


def resume_proof(out, checkpoint_path, nproc: int, *overrides: str) -> dict:
    if nproc == 1:
        run([sys.executable, PROOFS, str(out), "--resume", str(checkpoint_path), *overrides], timeout=120)
    else:
        torchrun(PROOFS, str(out), "--resume", str(checkpoint_path), *overrides, nproc=nproc, timeout=180)
    return json.loads((out / "resume.json").read_text())


@needs_fsdp
@pytest.mark.fsdp
@pytest.mark.slow
def test_a_ddp_checkpoint_loads_exactly_under_fsdp_and_back_on_other_world_sizes(tmp_path):
    steps = ("train.max_steps=6", "checkpoint.every_steps=3", "train.precision=fp32")
    torchrun(*train_args(tmp_path / "ddp", *steps), timeout=180)
    written = final_state(tmp_path / "ddp" / "smoke", 6)
    assert all(isinstance(name, str) for name in written["optimizer"]["state"])  # names, not positions
    proof = resume_proof(tmp_path / "fsdp3", tmp_path / "ddp" / "smoke", 3, "parallel.strategy=fsdp")
    assert proof["differ"] == [] and proof["names"] > 0 and proof["world_size"] == 3
    torchrun(*train_args(tmp_path / "fsdp", *steps, "parallel.strategy=fsdp"), timeout=180)
    proof = resume_proof(tmp_path / "ddp1", tmp_path / "fsdp" / "smoke", 1)  # and on 1 rank, as evaluate reads it
    assert proof["differ"] == [] and proof["strategy"] == "ddp" and proof["world_size"] == 1


def trained_step(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randint(0, 11, (2, 3))).sum().backward()
    optimizer.step()
    return optimizer


def test_a_checkpoint_holds_the_optimizer_state_by_name_and_one_by_position_still_loads():
    torch.manual_seed(0)
    model = TiedLanguageModel()
    optimizer = trained_step(model)
    weights, by_name = checkpoint.full_state(model, optimizer)
    assert sorted(by_name["state"]) == sorted(name for name, _ in model.named_parameters())
    for saved in (by_name, optimizer.state_dict()):  # the latter: checkpoints written before names
        fresh = TiedLanguageModel()
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        checkpoint.load_full_state(fresh, fresh_optimizer, {"model": weights, "optimizer": saved})
        assert_bit_identical(fresh.state_dict(), model.state_dict(), "model")
        assert_bit_identical(fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"], "optimizer")


@needs_fsdp
@pytest.mark.fsdp
@pytest.mark.task
def test_the_smoke_check_passes_under_fsdp_on_the_tasks_own_model(tmp_path):
    # the test-sized run in bf16: parameters gathered in bf16, BatchNorm's groups in fp32
    command = [
        "bash",
        "scripts/smoke.sh",
        "--config",
        SMOKE_CONFIG,
        "parallel.strategy=fsdp",
        f"run.out_dir={tmp_path}",
    ]
    result = run(command, env=project_env(CUDA_VISIBLE_DEVICES=""), timeout=300)
    assert "smoke: PASS (0 failed" in result.stdout, result.stdout[-3000:]
    rows = smoke_rows(result.stdout)
    for check in ("gradients all-reduced", "parameters equal on all ranks", "checkpoint round trip", "loss decreases"):
        assert rows[check][0] == "PASS", (check, rows[check])
    assert "reduce-scattered" in rows["gradients all-reduced"][1]


@needs_fsdp
@pytest.mark.fsdp
@pytest.mark.task
def test_the_same_run_under_fsdp_reaches_ddps_evaluation(tmp_path):
    # fp32 and no recompute: the two differ only in the order gradients are summed
    exact = ("train.precision=fp32", "train.max_steps=20", "eval.every=20", "eval.limit=256")
    results = {}
    for strategy in ("ddp", "fsdp"):
        torchrun(*train_args(tmp_path / strategy, *exact, f"parallel.strategy={strategy}"), timeout=300)
        evaluations = records.of_kind(read_metrics(tmp_path / strategy / "smoke"), records.EVAL)
        results[strategy] = records.eval_metrics(evaluations[-1])
    assert results["fsdp"].keys() == results["ddp"].keys()
    for name, value in results["ddp"].items():
        assert abs(results["fsdp"][name] - value) < 1e-3, (name, results)
