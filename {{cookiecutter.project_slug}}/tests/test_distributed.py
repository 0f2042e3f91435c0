"""The distributed maths, proven on 2 CPU ranks (gloo) against single-process references.

One torchrun launch runs every proof (tests/dist_proofs.py); each test checks one practice.
"""

import copy
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import dist_proofs
import pytest
import torch
from conftest import PROJECT, SMOKE_CONFIG, model_needs, run, runs_fsdp, torchrun

from {{ cookiecutter.package_name }} import config, task
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import loaders, parallel, sharded_checkpoint
from {{ cookiecutter.package_name }}.tools import checks
from {{ cookiecutter.package_name }}.tools.checks import FAIL, PASS

PROOFS = str(PROJECT / "tests" / "dist_proofs.py")
needs_fsdp = pytest.mark.skipif(bool(parallel.floor_problem()), reason=parallel.floor_problem() or "")
needs_sharded_checkpoints = pytest.mark.skipif(
    bool(sharded_checkpoint.floor_problem()), reason=sharded_checkpoint.floor_problem() or ""
)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, pytestconfig) -> dict:
    """The proofs' launch and the sharded loop's, side by side (each leaves a core idle half the
    time): {name: (result, out)}. The sharded proofs run in a launch of their own: FSDP keeps the
    process group's gloo threads alive past teardown (torch 2.14), which the teardown proof below
    must not see; and only where the tests marked fsdp run (conftest.runs_fsdp). A failing proof
    exits 1, and the tests below say which one failed."""
    sharded = runs_fsdp(pytestconfig) and not parallel.floor_problem()
    commands = {"proofs": []} | ({"fsdp": ["--only", "fsdp"]} if sharded else {})
    outs = {name: tmp_path_factory.mktemp(name) for name in commands}

    def launch(name):
        command = [PROOFS, str(outs[name]), *commands[name], *model_needs()]  # as the project trains its model
        return torchrun(*command, nproc=2, timeout=180, check=False), outs[name]

    with ThreadPoolExecutor(len(commands)) as pool:
        return dict(zip(commands, pool.map(launch, commands), strict=True))


@pytest.fixture(scope="module")
def proofs_launch(launches):
    return launches["proofs"]


@pytest.fixture(scope="module")
def proofs(proofs_launch):
    result, out = proofs_launch
    assert (out / "proofs-2.json").exists(), result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads((out / "proofs-2.json").read_text())


def test_the_proofs_print_a_verdict_per_proof_and_exit_0_when_all_hold(proofs_launch):
    result, _ = proofs_launch
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]  # a proof that raised: its traceback
    assert "proofs on 2 ranks: PASS (0 failed, 0 warnings)" in result.stdout
    assert sum(line.startswith("PASS") for line in result.stdout.splitlines()) == 9


def test_every_rank_leaves_no_thread_of_the_process_group_behind_at_exit(proofs_launch):
    # a gloo thread alive at interpreter shutdown can abort a finished run (dist.run_in_group)
    _, out = proofs_launch
    for rank in range(2):
        threads = json.loads((out / f"threads-rank{rank}.json").read_text())
        assert threads["after_teardown"] == threads["before_init"], f"rank {rank}: {threads}"


def test_a_gradient_off_by_more_than_rounding_fails_its_verdict_with_the_likely_causes(proofs):
    drifted = copy.deepcopy(proofs)
    drifted["equivalence"]["gradient_error"] = 0.47
    rows = dist_proofs.verdicts(drifted)
    assert [verdict for verdict, _, _ in rows].count(FAIL) == 1 and checks.exit_code(rows) == 1
    failed = next(detail for verdict, _, detail in rows if verdict == FAIL)
    assert "4.7e-01" in failed and "SUM" in failed  # no probe found a cause: what to check
    drifted["causes"] = ["task.loss_sum looks like a mean"]
    failed = next(detail for verdict, _, detail in dist_proofs.verdicts(drifted) if verdict == FAIL)
    assert failed.endswith("(6 steps); task.loss_sum looks like a mean")


def test_the_proofs_batch_fits_every_micro_batch_of_a_step_into_a_small_training_set(monkeypatch):
    # 100 samples on 2 ranks with 4 micro-batches a step: 50 a rank hold 4 batches of 12, not of 32
    monkeypatch.setattr(dist_proofs.loaders, "datasets", lambda cfg: (range(100), range(10)))
    cfg = config.load(SMOKE_CONFIG, ["data.batch_size=32"])
    assert dist_proofs.fitting_batch(cfg, world_size=2, accum=4) == 12
    assert dist_proofs.fitting_batch(cfg, world_size=2, accum=1) == 32
    assert dist_proofs.fitting_batch(cfg, world_size=2, accum=64) == 0  # not one sample a micro-batch: skipped


def test_the_probes_find_a_mean_where_the_loop_needs_a_sum(monkeypatch):
    assert dist_proofs.drift_causes([]) == []  # the project's task: a sum, no state
    ratio, _ = dist_proofs.probe_task([])
    if abs(ratio - 2) > 0.25:
        pytest.skip(
            f"task.loss_sum of 4 samples given twice is {ratio:.2f} times their loss, not 2: its terms see each "
            "other (contrastive negatives, a batch-level loss), so this probe cannot tell a mean; the proofs still do"
        )
    loss_sum = task.loss_sum
    monkeypatch.setattr(task, "loss_sum", lambda model, batch: loss_sum(model, batch) / task.count_terms(batch))
    (cause,) = dist_proofs.drift_causes([])
    assert cause.startswith("task.loss_sum looks like a mean: the same samples given twice gave 1.00 times")


def test_the_probes_find_state_a_forward_keeps(monkeypatch):
    loss_sum = task.loss_sum

    def counts_its_calls(model, batch):
        model.register_buffer("calls", getattr(model, "calls", torch.zeros(())) + 1)  # state the forward keeps
        return loss_sum(model, batch)

    monkeypatch.setattr(task, "loss_sum", counts_its_calls)
    (cause,) = dist_proofs.drift_causes([])
    assert cause.startswith("the forward changes the model's state (calls)")


def test_a_proof_that_ran_no_step_fails_instead_of_passing_on_nothing(proofs):
    starved = copy.deepcopy(proofs)  # a training set smaller than one accumulated step per rank
    starved["accumulation"] |= {"steps": 0, "gradient_error": 0.0, "buckets_per_sync": []}
    failed = {what: detail for verdict, what, detail in dist_proofs.verdicts(starved) if verdict == FAIL}
    assert set(failed) == {"no_sync == big batch", "1 all-reduce per step"}
    assert "pass a smaller data.batch_size" in failed["no_sync == big batch"]


def test_ddp_on_two_ranks_equals_one_process_on_the_global_batch(proofs):
    result = proofs["equivalence"]
    assert result["steps"] == 6
    assert result["gradient_error"] < dist_proofs.GRADIENT_TOLERANCE, dist_proofs.DRIFT  # float32 rounding


def test_evaluation_uses_rank_0s_batchnorm_statistics_on_every_rank(proofs):
    # the weights a checkpoint saves (rank 0's), not each rank's statistics of its own batches
    first, second = proofs["equivalence"]["buffers"]
    assert first == second


def test_accumulation_with_no_sync_equals_one_big_batch(proofs):
    result = proofs["accumulation"]
    assert result["steps"] == 4
    assert result["gradient_error"] < dist_proofs.GRADIENT_TOLERANCE, dist_proofs.DRIFT


def test_accumulation_communicates_only_on_the_last_micro_batch(proofs):
    result = proofs["accumulation"]
    assert result["micro_batches"] == 16
    per_sync = result["buckets_per_sync"]
    assert len(per_sync) == result["steps"] == 4  # one all-reducing backward per optimizer step
    # every bucket once in each; DDP rebuilds its buckets after the first step in the order the
    # gradients became ready, which can change their number once
    assert min(per_sync) >= 1 and len(set(per_sync[1:])) == 1


def test_unequal_loss_terms_are_weighted_by_the_global_count(proofs):
    result = proofs["weighting"]
    assert result["terms"][0] != result["terms"][1]
    assert result["max_difference"] < dist_proofs.WEIGHTING_TOLERANCE
    assert result["mean_of_means_difference"] > 1e-4  # the naive rule would not pass this proof


def test_every_rank_builds_the_same_initial_weights(proofs):
    first, second = proofs["initial_weights"]["checksums"]
    assert first == second  # same seed on every rank, before the model is built


def test_unequal_loader_lengths_stop_every_rank_at_start_up_instead_of_hanging(proofs):
    messages = proofs["unequal_lengths"]["messages"]  # raised by train.build, the loop's own start-up
    cfg = config.load(SMOKE_CONFIG)
    shard = len(task.build_datasets(cfg)[0]) // 2 // cfg.data.batch_size
    assert all(f"train loader length differs across ranks ({shard - 2}..{shard} batches" in m for m in messages)


def test_every_rank_reads_its_shard_in_a_new_order_each_epoch(proofs):
    orders = proofs["epochs"]["orders"]  # what each rank read in the loop's own run, epoch by epoch
    assert len(orders) == 2 and all(len(epochs) == 3 for epochs in orders)
    for epochs in orders:
        assert len({tuple(order) for order in epochs}) == 3  # sampler.set_epoch at every epoch
    for shards in zip(*orders, strict=True):
        assert sorted(shards[0] + shards[1]) == list(range(2 * len(shards[0])))  # together, every sample once
    assert dist_proofs.reshuffle_verdict(orders)[0] == PASS


def test_ddp_wrapping_settings(proofs):
    wrapping = proofs["wrapping"]
    assert wrapping["is_ddp"] and wrapping["eval_model_is_unwrapped"]
    assert wrapping["gradient_as_bucket_view"] is True
    # off unless the model needs it (it costs a graph walk a step): as configs/default.yaml says, false as shipped
    assert model_needs() == [f"parallel.find_unused_parameters={str(wrapping['find_unused_parameters']).lower()}"]
    assert config.load(None).parallel.find_unused_parameters is False
    assert wrapping["bucket_bytes_cap"] == 7 * 1024 * 1024  # parallel.bucket_cap_mb


def test_eval_on_two_ranks_gives_the_metrics_of_one_process(proofs):
    # global sums over ranks, not a mean of per-rank means: the ranks hold unequal shares of an odd-sized set
    alone = dist_proofs.prove_eval_counts([], dist_proofs.world_of_one())
    assert proofs["eval"] == pytest.approx(alone, rel=1e-6)  # fp32 sums in another order


@pytest.mark.task
def test_eval_counts_each_sample_once_for_world_sizes_1_2_3(proofs, tmp_path):
    run([sys.executable, PROOFS, str(tmp_path), "--only", "eval"], timeout=60)
    torchrun(PROOFS, str(tmp_path), "--only", "eval", nproc=3, timeout=120)
    by_world = {w: json.loads((tmp_path / f"proofs-{w}.json").read_text())["eval"] for w in (1, 3)}
    by_world[2] = proofs["eval"]
    _, eval_set = task.build_datasets(config.load(SMOKE_CONFIG))
    assert {r["eval_samples"] for r in by_world.values()} == {len(eval_set)}  # with padding where it does not split
    for name in by_world[1]:
        values = [r[name] for r in by_world.values()]
        assert max(values) - min(values) <= 1e-6 * max(1.0, abs(max(values))), name  # fp32 sums in another order


def leaves(batch) -> list:
    if isinstance(batch, dict):
        return [leaf for value in batch.values() for leaf in leaves(value)]
    if isinstance(batch, (list, tuple)):
        return [leaf for value in batch for leaf in leaves(value)]
    return [batch]


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_reference_takes_each_ranks_batches_from_the_epoch_a_step_falls_in():
    """A small dataset's epoch can end within the proofs' steps: the reference must follow the
    loader into the next epoch, not read past the end of epoch 0."""
    cfg = config.load(SMOKE_CONFIG, [*dist_proofs.EXACT_MATHS])
    train_set, eval_set = task.build_datasets(cfg)
    collate = loaders.build_loaders(train_set, eval_set, cfg, dist_proofs.world_of_one(), 0)[0].collate_fn
    ranks = [DistInfo(r, r, 2, 2, torch.device("cpu"), "gloo") for r in range(2)]
    epoch_1_loaders = [loaders.build_loaders(train_set, eval_set, cfg, info, 0)[0] for info in ranks]
    steps_per_epoch = len(epoch_1_loaders[0]) // cfg.train.grad_accum_steps
    reference = dist_proofs.step_batches(train_set, collate, 2, steps_per_epoch, cfg)  # epoch 1's first step
    reference = [micro_batches[0] for micro_batches in reference]  # [rank][micro-batch]: one micro-batch a step
    for loader in epoch_1_loaders:
        loader.sampler.set_epoch(1)
    if hasattr(train_set, "set_epoch"):
        train_set.set_epoch(1)
    loop = [next(iter(loader)) for loader in epoch_1_loaders]
    for ours, theirs in zip(reference, loop, strict=True):
        assert all(same(a, b) for a, b in zip(leaves(ours), leaves(theirs), strict=True))


@pytest.fixture(scope="module")
def sharded_launch(launches):
    return launches["fsdp"]


@pytest.fixture(scope="module")
def sharded(sharded_launch):
    result, out = sharded_launch
    assert (out / "fsdp-2.json").exists(), result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads((out / "fsdp-2.json").read_text())


@needs_fsdp
@pytest.mark.fsdp
def test_the_fsdp_proofs_print_a_verdict_per_proof_and_exit_0_when_all_hold(sharded_launch):
    result, _ = sharded_launch
    assert result.returncode == 0 and "fsdp proofs on 2 ranks: PASS (0 failed" in result.stdout, result.stdout[-3000:]
    assert sum(line.startswith("PASS") for line in result.stdout.splitlines()) == 6


@needs_fsdp
@pytest.mark.fsdp
@pytest.mark.parametrize("name", ["equivalence", "accumulation", "accumulation_whole"])
def test_fsdp_gradients_and_updates_equal_one_process_on_the_global_batch(sharded, name):
    # accumulation over 4 micro-batches, gradients reduced at each (sharded between them) or only
    # at the last (whole); activation checkpointing on; clipping at every step, over the shards
    result = sharded[name]
    assert result["steps"] > 0
    assert result["gradient_error"] < dist_proofs.GRADIENT_TOLERANCE, dist_proofs.DRIFT
    assert result["update_error"] < dist_proofs.UPDATE_TOLERANCE  # the sharded optimizer's step is the whole one's


@needs_fsdp
@pytest.mark.fsdp
def test_fsdp_evaluation_counts_each_sample_once_with_rank_0s_batchnorm_statistics(sharded):
    result = sharded["equivalence"]
    assert result["evaluation"]["eval_samples"] == result["eval_set"]
    assert dist_proofs.metrics_alike(result["evaluation"], result["evaluation_alone"])
    first, second = result["buffers"]
    assert first == second  # broadcast from rank 0 before evaluating, as DDP leaves them


@needs_fsdp
@pytest.mark.fsdp
def test_fsdp_shards_every_unit_and_recomputes_their_activations(sharded):
    shard = sharded["sharding"]
    assert shard["units"] > 0 and shard["units_sharded"] == shard["units"] and shard["root_sharded"]
    assert shard["parameters_sharded"]
    assert shard["units_recomputed"] == shard["units"] - shard["units_with_batchnorm"]


@needs_fsdp
@pytest.mark.fsdp
def test_fsdp_holds_half_of_ddps_state_on_two_ranks_as_estimated(sharded):
    verdict, _, detail = dist_proofs.memory_verdict(sharded["equivalence"])
    assert verdict == PASS, detail


@needs_fsdp
@pytest.mark.fsdp
@pytest.mark.slow
def test_fsdp_proofs_hold_on_three_ranks_with_uneven_shards(tmp_path):
    result = torchrun(PROOFS, str(tmp_path), "--only", "fsdp", nproc=3, timeout=240, check=False)
    assert "fsdp proofs on 3 ranks: PASS" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


# ---- Activation checkpointing with dropout, and the fsdp settings' effects (dist_proofs.py) ----


def test_recomputed_units_with_dropout_give_the_gradients_of_no_recompute_under_ddp_on_two_ranks(proofs):
    result = proofs["recompute"]
    assert result["other_masks"] > 1e-3  # dropout is on: other masks, other gradients
    assert result["full"] == 0 and result["selective"] == 0  # the recompute replays the forward's masks


def test_a_loss_over_every_ranks_rows_gets_one_processs_gradient_through_the_gather(proofs):
    # base.across_ranks on 2 ranks of 2 and 3 rows: the gradient each rank's loss sends to another's rows comes back
    assert proofs["gather"]["firsts"] == [0, 2] and proofs["gather"]["gradient_error"] < 1e-12


@needs_sharded_checkpoints
def test_a_background_write_that_fails_on_one_rank_stops_every_rank_at_the_next_save(proofs):
    result = proofs["failed_write"]
    for raised in result["raised"]:  # rank 1's disk was full; rank 0 stops too, with the same line
        assert raised.startswith("the background write of checkpoint step_00000001 failed (on rank 1: OSError: ")
    assert result["published"] == []


@needs_fsdp
@pytest.mark.fsdp  # rides on the sharded launch, which runs where the tests marked fsdp run
def test_recomputed_units_with_dropout_give_the_gradients_of_no_recompute_under_fsdp_on_two_ranks(sharded):
    result = sharded["recompute"]
    assert result["other_masks"] > 1e-3
    assert result["full"] == 0 and result["selective"] == 0


@needs_fsdp
@pytest.mark.fsdp  # rides on the sharded launch, which runs where the tests marked fsdp run
def test_fsdp_settings_decide_what_is_gathered_after_forward_and_what_is_reduced_each_micro_batch(sharded):
    for setting, seen in sharded["settings"].items():
        reshard, every = (part.split("=")[1] == "True" for part in setting.split(","))
        assert seen == {"gathered_after_forward": not reshard, "reduced": every}, setting
