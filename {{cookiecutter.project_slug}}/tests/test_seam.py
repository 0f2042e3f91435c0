"""The seam's contract, held whatever model the project trains: the loop, the tests and their
helpers, the smoke check, `diagnose` and the proofs call the model only through the task's
functions and pass its arguments through unchanged, and a task reaches its module through
batching.unwrap. Three stand-in tasks (tests/stand_ins.py) are installed in place of the project's
seam: a model whose forward requires a state, one called with keyword arguments only, and one that
routes tokens to experts, which some batches leave without a gradient. The fast tier runs them in
this process; the slow tier runs the proofs and the smoke check on them on 2 ranks, under ddp (and
fsdp, but the routed one)."""

import json
import sys

import dist_proofs
import pytest
import torch
from conftest import PROJECT, SMOKE_CONFIG, WORLD_OF_ONE, read_metrics, run, torchrun
from stand_ins import DDP_ONLY, SETTINGS, STAND_INS, Recurrent, RecurrentTask, install
from torch.nn.parallel import DistributedDataParallel

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base import records
from {{ cookiecutter.package_name }}.base.batching import unwrap
from {{ cookiecutter.package_name }}.loop import loaders, parallel, preflight
from {{ cookiecutter.package_name }}.tools import diagnose, evaluate, smoke

QUICK = ["data.num_workers=0", "run.tensorboard=false", "data.batch_size=4"]


@pytest.mark.usefixtures("process_settings")
@pytest.mark.parametrize("name", STAND_INS)
def test_a_model_that_needs_a_state_or_only_keywords_trains_checks_and_diagnoses_through_the_task(
    name, monkeypatch, tmp_path, capsys
):
    install(name, monkeypatch)
    steps = ["train.max_steps=4", "checkpoint.every_steps=2", "run.log_every=2", "eval.limit=9"]
    cfg = config.load(SMOKE_CONFIG, [*QUICK, *steps, f"run.out_dir={tmp_path}"])
    assert train.run(cfg, WORLD_OF_ONE) == 0  # the start-up check, the steps, a checkpoint, evaluation
    logged = read_metrics(cfg.run_dir)
    assert [r["step"] for r in records.of_kind(logged, records.TRAIN)] == [2, 4]
    assert records.of_kind(logged, records.EVAL)[-1][records.EVAL_SAMPLES] == 9
    cfg = config.load(SMOKE_CONFIG, [*QUICK, "train.max_steps=6", f"run.out_dir={tmp_path}"])
    assert train.run(cfg, WORLD_OF_ONE) == 0 and "resumed from" in capsys.readouterr().out
    # the final checkpoint evaluated by the command: the run's own last evaluation (its batches, its metrics)
    assert evaluate.main([str(cfg.run_dir.root), "--out", str(tmp_path / "evaluated.json")]) == 0
    evaluated = json.loads((tmp_path / "evaluated.json").read_text())
    logged = records.of_kind(read_metrics(cfg.run_dir), records.EVAL)[-1]
    assert {k: evaluated[k] for k in logged if k != "kind"} == {k: v for k, v in logged.items() if k != "kind"}
    capsys.readouterr()

    # diagnose unused, as its command line runs it: the helpers' wrapper passes calls and reads through
    assert diagnose.main(["unused", "--config", SMOKE_CONFIG, "--model", "helpers:model_with_unused_head"]) == 1
    assert capsys.readouterr().out.split("\n", 1)[1].split() == ["aux_head.weight", "aux_head.bias"]
    routed = name == "routed"  # some pairs of samples leave experts without a gradient: a rank's batch can too
    assert diagnose.main(["unused", "--config", SMOKE_CONFIG]) == routed
    said = capsys.readouterr().out
    assert ("set parallel.find_unused_parameters=true" in said and "experts.3.weight" in said) == routed, said
    assert diagnose.main(["unused", "--config", SMOKE_CONFIG, *SETTINGS.get(name, [])]) == 0  # as its project sets
    said = capsys.readouterr().out
    assert ("which parallel.find_unused_parameters=true reduces" in said and "experts.3.weight" in said) == routed
    if routed:  # its forward reads which expert each token picks: fake tensors cannot trace it
        with pytest.raises(SystemExit) as exit_code:
            diagnose.main(["memory", "--config", SMOKE_CONFIG])
        assert exit_code.value.code == 2 and "reads its data's values" in capsys.readouterr().err

    checked = config.load(SMOKE_CONFIG, [*smoke.SMOKE_RUN, *QUICK, "train.max_steps=4", f"run.out_dir={tmp_path}"])
    failed = [what for verdict, what, _ in smoke.run_checks(checked, WORLD_OF_ONE) if verdict == "FAIL"]
    assert set(failed) <= {"loss decreases"}, failed  # four steps need not learn

    # the proofs' own calls of the task (their one-process references), here in a world of one
    weighting = dist_proofs.prove_unequal_terms_are_weighted_globally(tmp_path / "proofs", [], WORLD_OF_ONE)
    assert weighting["max_difference"] < dist_proofs.WEIGHTING_TOLERANCE
    counted = dist_proofs.prove_eval_counts([], WORLD_OF_ONE)
    assert counted[records.EVAL_SAMPLES] == counted["dataset_size"]


@pytest.mark.parametrize("name", STAND_INS)
def test_the_weighting_proof_names_the_setting_a_routed_model_needs_instead_of_a_step_that_hangs(name, monkeypatch):
    """Rank 0's 3 samples leave an expert of the routed stand-in without a gradient, rank 1's 8 do not:
    under ddp the proof asks for find_unused_parameters, under fsdp for experts that always run."""
    install(name, monkeypatch)
    found = {}
    for setting in ("parallel.strategy=ddp", "parallel.find_unused_parameters=true", "parallel.strategy=fsdp"):
        cfg = config.load(SMOKE_CONFIG, [*QUICK, setting])
        model = task.build_model(cfg)
        batches = dist_proofs.unequal_batches(
            cfg, loaders.build_loaders(*loaders.datasets(cfg), cfg, WORLD_OF_ONE, 0)[0].collate_fn, 2
        )
        found[setting.split(".")[1]] = dist_proofs.unreduced_parameters(model, batches, cfg)
    if name != "routed":
        assert found == dict.fromkeys(found)
        return
    assert found["strategy=ddp"].startswith("rank 0's 3 samples leave experts.3.bias, experts.3.weight without")
    assert found["strategy=ddp"].endswith("set parallel.find_unused_parameters=true (`diagnose unused` lists them)")
    assert found["find_unused_parameters=true"] is None and SETTINGS[name] == ["parallel.find_unused_parameters=true"]
    assert "other ranks' do not" in found["strategy=fsdp"] and "pytorch#158719" in found["strategy=fsdp"]


def start_up_pieces(cfg):
    datasets = task.build_datasets(cfg)
    return list(zip(datasets, loaders.build_loaders(*datasets, cfg, WORLD_OF_ONE, 0), strict=True))


def test_the_start_up_check_calls_each_function_in_its_mode_and_leaves_no_trace(monkeypatch):
    install("detector", monkeypatch)  # losses in train mode only, detections in eval mode only
    cfg = config.load(SMOKE_CONFIG, QUICK)
    model = task.build_model(cfg)
    model.register_buffer("statistic", torch.zeros(()))
    loss_sum = task.loss_sum

    def counts_in_its_forward(model, batch):  # as BatchNorm updates its running statistics in train mode
        unwrap(model).statistic += 1
        return loss_sum(model, batch)

    monkeypatch.setattr(task, "loss_sum", counts_in_its_forward)
    before, generator = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
    preflight.check_task(model.eval(), *start_up_pieces(cfg))  # built in eval mode, as from_pretrained returns
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), generator) and not model.training


def test_a_loss_that_gathers_other_ranks_rows_must_say_so_and_one_that_says_so_must_gather(monkeypatch):
    install("contrastive", monkeypatch)
    cfg = config.load(SMOKE_CONFIG, QUICK)
    preflight.check_task(task.build_model(cfg), *start_up_pieces(cfg))
    monkeypatch.setattr(task, "LOSS_SPANS_RANKS", False)
    with pytest.raises(preflight.TaskError, match="calls gather_from_ranks, but task.LOSS_SPANS_RANKS is not True"):
        preflight.check_task(task.build_model(cfg), *start_up_pieces(cfg))
    install("keyword", monkeypatch)
    monkeypatch.setattr(task, "LOSS_SPANS_RANKS", True, raising=False)
    with pytest.raises(preflight.TaskError, match="LOSS_SPANS_RANKS is True, but task.loss_sum never called"):
        preflight.check_task(task.build_model(cfg), *start_up_pieces(cfg))


def test_unwrap_reaches_the_module_under_ddp_and_compile():
    module = Recurrent()
    assert unwrap(module) is module and unwrap(torch.compile(module)) is module
    assert unwrap(preflight.Wrapped(module)) is module
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # its attributes without a process group
    torch.nn.Module.__init__(ddp)
    ddp.module = torch.compile(module)
    assert unwrap(ddp) is module  # train.wrap's nesting: DDP(compiled(module)); fully_shard wraps nothing


def test_a_task_that_reads_its_module_off_the_wrapped_model_stops_before_training_naming_unwrap(monkeypatch):
    install("recurrent", monkeypatch)

    def reads_the_wrapper(model, batch):  # what DDP would refuse at the first step, on every rank
        logits, _ = model(batch[:, :-1], model.init_state(len(batch), batch.device))
        return logits.sum()

    monkeypatch.setattr(task, "loss_sum", reads_the_wrapper)
    cfg = config.load(SMOKE_CONFIG, QUICK)
    datasets = task.build_datasets(cfg)
    pieces = list(zip(datasets, loaders.build_loaders(*datasets, cfg, WORLD_OF_ONE, 0), strict=True))
    with pytest.raises(preflight.TaskError, match=r"has no attribute 'init_state'.*batching\.unwrap\(model\)"):
        preflight.check_task(task.build_model(cfg), *pieces)
    monkeypatch.setattr(task, "loss_sum", RecurrentTask.loss_sum)  # through unwrap: the check passes
    preflight.check_task(task.build_model(cfg), *pieces)


@pytest.mark.slow
def test_the_proofs_and_the_smoke_check_hold_on_two_ranks_for_a_model_that_needs_a_state_and_one_of_keywords(
    tmp_path,
):
    sharded = not parallel.floor_problem()  # the sharded loop's too: these models shard, in any project
    launch = [str(PROJECT / "tests" / "stand_ins.py"), str(tmp_path), *(["--fsdp"] if sharded else [])]
    result = torchrun(*launch, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    tables = result.stdout.split("stand-in ")[1:]
    assert [table.split()[0] for table in tables] == list(STAND_INS)
    for name, table in zip(STAND_INS, tables, strict=True):
        both = sharded and name not in DDP_ONLY
        assert "proofs on 2 ranks: PASS (0 failed" in table
        assert ("fsdp proofs on 2 ranks: PASS (0 failed" in table) == both
        assert table.count("smoke: PASS (0 failed") == 1 + both  # under ddp, and fsdp


@pytest.mark.slow
def test_each_stand_ins_evaluation_is_the_same_on_one_two_and_three_ranks(tmp_path):
    """Every sample once, in batches that do not depend on the world size: the detector, whose outputs
    depend on which images share a batch, and the dataset-level metrics (mAP, kNN accuracy) too."""
    launch = [str(PROJECT / "tests" / "stand_ins.py"), str(tmp_path), "--eval"]
    run([sys.executable, *launch], timeout=120)
    for nproc in (2, 3):
        torchrun(*launch, nproc=nproc, timeout=180)
    for name in STAND_INS:
        by_world = [json.loads((tmp_path / name / f"proofs-{w}.json").read_text())["eval"] for w in (1, 2, 3)]
        assert by_world[0]["eval_samples"] == by_world[0]["dataset_size"] == 61, name
        for metric in by_world[0]:
            values = [evaluation[metric] for evaluation in by_world]
            assert max(values) - min(values) <= 1e-9 * max(1.0, abs(values[0])), (name, metric, values)
