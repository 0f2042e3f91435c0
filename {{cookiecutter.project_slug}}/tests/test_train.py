"""End-to-end training runs: the launch users run, each precision, compile, NaN handling."""

import json
import signal
import sys
from types import SimpleNamespace

import dist_proofs
import pytest
import stand_ins
import torch
import yaml
from conftest import (
    PACKAGE,
    PROJECT,
    SMOKE_CONFIG,
    needs_cuda,
    needs_two_gpus,
    project_env,
    read_metrics,
    run,
    torchrun,
    train_args,
    train_losses,
)
from torch.utils.data import default_collate

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base import hardware, preemption, records
from {{ cookiecutter.package_name }}.base.batching import unwrap
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint, loaders, parallel, preflight, startup
from {{ cookiecutter.package_name }}.task import build_model
from {{ cookiecutter.package_name }}.tools import evaluate

FAULTY = str(PROJECT / "tests" / "faulty_train.py")


@pytest.mark.slow
def test_two_process_run_trains_and_reports(tmp_path):
    result = torchrun(*train_args(tmp_path, "run.name=e2e"), timeout=180)
    out = result.stdout
    smoke = config.load(SMOKE_CONFIG)
    train_set, eval_set = task.build_datasets(smoke)
    epoch = len(train_set) // 32  # optimizer steps in an epoch: 16 per device x 2 ranks, last partial batch dropped
    main_metric = task.MAIN_METRIC[0]
    for line in (
        "world size 2 (2 per node), backend gloo",
        "global batch 32 = 16 per device x 2 ranks x 1",
        f"lr {smoke.optim.lr:.3g} (optim.lr, tuned at batch 32; global batch 32: not scaled)",
        "static memory per device",
        "loader workers per rank",
        f"eval step {epoch} | epoch 0 | loss ",
        f"| {len(eval_set)} samples",
        f"done: {2 * epoch} steps in ",
        f"; eval {main_metric}: best ",
    ):
        assert line in out
    assert out.count("world size") == 1  # printed by rank 0 only
    unused = "note: parallel.sync_batchnorm is on but unused: SyncBatchNorm needs CUDA" in out
    assert unused == train.has_batchnorm(build_model(smoke))  # nothing to say about a model without BatchNorm
    precision_note = hardware.precision_note(smoke.train.precision, torch.device("cpu"))
    assert precision_note is None or precision_note in out
    losses = train_losses(tmp_path / "e2e")
    assert losses[-1] < 0.8 * losses[0]  # how far it must get is each task's own test (test_task.py)
    evals = [r for r in read_metrics(tmp_path / "e2e") if f"eval_{main_metric}" in r]
    assert len(evals) == 2 and evals[-1]["eval_samples"] == len(eval_set)
    assert {"samples_per_s", "data_wait_share", "lr"} <= set(read_metrics(tmp_path / "e2e")[0])
    # the checkpoint of a DDP run loads into a plain model with strict key matching
    state = checkpoint.load_file(tmp_path / "e2e" / "checkpoints" / f"step_{2 * epoch:08d}.pt")
    build_model(config.load(tmp_path / "e2e" / "config.yaml")).load_state_dict(state["model"])


# each case's settings besides the exact maths: 2 ranks, with accumulation, sharded with accumulation
NORM_CASES = {
    "ddp": ("parallel.strategy=ddp",),
    "ddp-accumulation": ("parallel.strategy=ddp", "train.grad_accum_steps=2"),
    "fsdp-accumulation": ("parallel.strategy=fsdp", "train.grad_accum_steps=2"),
}
FSDP_FLOOR = parallel.floor_problem()
SHARDED = [pytest.mark.fsdp, pytest.mark.skipif(bool(FSDP_FLOOR), reason=FSDP_FLOOR or "")]  # the project's model


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp", "ddp-accumulation", pytest.param("fsdp-accumulation", marks=SHARDED)])
def test_the_gradient_norm_logged_on_2_ranks_is_one_processs_on_the_global_batch(tmp_path, case):
    """Step 2 of a 2-rank run against one process's gradient on the same samples from the weights
    step 1 left (its checkpoint), each rank's micro-batch a forward pass of its own as on its rank
    (BatchNorm sees the batches it saw), in float64: the exact norm, which the run's float32 meets
    to rounding (a float32 reference is 5e-4 off on the image starter's ResNet at 32 px, whose
    BatchNorm amplifies rounding). A norm summed over the ranks instead of reduced to the global
    one is off by their count (in a world of one such a slip logs the right number)."""
    overrides = (*dist_proofs.EXACT_MATHS, "train.max_steps=2", "run.log_every=1", "checkpoint.every_steps=1")
    overrides += NORM_CASES[case]
    torchrun(*train_args(tmp_path, *overrides), timeout=180)
    run_dir = tmp_path / "smoke"
    windows = records.of_kind(read_metrics(run_dir), records.TRAIN)
    logged = {r["step"]: r["grad_norm"] for r in windows}
    cfg = config.load(SMOKE_CONFIG, [f"run.out_dir={tmp_path}", *overrides])
    global_batch = cfg.data.batch_size * 2 * cfg.train.grad_accum_steps
    assert [samples_a_step(r) for r in windows] == pytest.approx([global_batch] * 2)  # every rank's micro-batch
    model = build_model(cfg)
    model.load_state_dict(checkpoint.find(RunDir(run_dir).saved_checkpoints()[0])[1]["model"])  # step 1's
    train_set, eval_set = loaders.datasets(cfg)
    collate = loaders.build_loaders(train_set, eval_set, cfg, dist_proofs.world_of_one(), 0)[0].collate_fn
    model.double().train()
    step = dist_proofs.step_batches(train_set, collate, 2, 1, cfg)  # [rank][micro-batch]
    batches = [[in_float64(batch) for batch in micro_batches] for micro_batches in step]
    dist_proofs.reference_gradients(model, batches)
    gradient = torch.cat([dist_proofs.gradient_of(p).flatten() for p in model.parameters()])
    reference = torch.linalg.vector_norm(gradient).item()
    assert logged[2] == pytest.approx(reference, rel=1e-5), (
        f"step 2 logged grad_norm {logged[2]:.6g}; one process's on the same samples is {reference:.6g}: a ratio of "
        f"2 is a norm summed over the ranks, not reduced to the global one; otherwise {dist_proofs.DRIFT}"
    )


def in_float64(batch):
    """The batch with its floating-point tensors in float64, inside tuples, lists and dicts."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {key: in_float64(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(in_float64(value) for value in batch)
    return batch


def samples_a_step(record: dict) -> float:
    """A log window's samples per optimizer step, from its speed and its mean step time."""
    return record["samples_per_s"] * record["step_ms"] / 1000


@pytest.mark.usefixtures("process_settings")
def test_the_logged_speed_counts_every_micro_batch_of_a_step(tmp_path, monkeypatch):
    stand_ins.install("plain", monkeypatch)  # the loop's log, the same whatever the model
    settings = [f"run.out_dir={tmp_path}", "run.tensorboard=false", "data.num_workers=0", "run.log_every=1"]
    cfg = config.load(SMOKE_CONFIG, [*settings, "train.max_steps=2", "train.grad_accum_steps=2", "data.batch_size=4"])
    assert train.run(cfg, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")) == 0
    windows = records.of_kind(read_metrics(cfg.run_dir.root), records.TRAIN)
    assert [samples_a_step(r) for r in windows] == pytest.approx([4 * 2] * 2)  # batch 4 x accumulation 2


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "fp32", "bf16"])
def test_world_of_one_trains_in_each_precision(tmp_path, precision):
    run([sys.executable, *train_args(tmp_path, f"train.precision={precision}", "train.max_steps=128")], timeout=180)
    losses = train_losses(tmp_path / "smoke")
    assert losses[-1] < 0.8 * losses[0]
    state = checkpoint.load_file(tmp_path / "smoke" / "checkpoints" / "step_00000128.pt")
    assert (state["scaler"]["scale"] > 0) if precision == "fp16" else (state["scaler"] == {})


@pytest.mark.slow
def test_non_finite_loss_stops_every_rank_with_advice(tmp_path):
    result = torchrun(
        FAULTY,
        *train_args(tmp_path)[2:],
        nproc=2,
        timeout=120,
        check=False,
        env=project_env(FAULT="nan", FAULT_RANK="1", FAULT_STEP="3"),
    )
    assert result.returncode != 0
    for rank in (0, 1):  # rank 1 produced the NaN; the reduced loss stops rank 0 too
        line = f"[rank {rank}/2] FloatingPointError: loss is nan or inf between steps 1 and 5: lower optim.lr"
        assert line in result.stderr


@pytest.mark.slow
def test_eval_every_keeps_its_schedule_across_a_resume_and_counts_every_sample(tmp_path):
    overrides = ("eval.every=20", "eval.at_start=true", "checkpoint.every_steps=20")
    first = torchrun(*train_args(tmp_path, *overrides, "train.max_steps=50"), timeout=120)
    assert "eval step 0 | epoch 0 |" in first.stdout and "eval step 20 | epoch 0 |" in first.stdout
    torchrun(*train_args(tmp_path, *overrides, "train.max_steps=90"), timeout=120)  # resumes at 50
    evals = records.of_kind(read_metrics(tmp_path / "smoke"), records.EVAL)
    # every 20 steps, the baseline at 0 and each run's end; none twice, none skipped by the resume
    assert [e["step"] for e in evals] == [0, 20, 40, 50, 60, 80, 90]
    eval_set = task.build_datasets(config.load(SMOKE_CONFIG))[1]
    assert {e["eval_samples"] for e in evals} == {len(eval_set)}


def test_evaluate_names_what_to_pass_when_the_target_holds_no_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="does not exist: pass a run directory"):
        checkpoint.find(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="holds no loadable checkpoint: pass a run directory"):
        checkpoint.find(tmp_path)  # a directory, but not a run's
    written = evaluate.output_of(tmp_path, tmp_path / "checkpoints" / "step_00000020.pt", None)
    assert written == tmp_path / "evaluations" / "step_00000020.json"  # a run directory's evaluations/


@pytest.mark.slow
def test_evaluate_gives_a_checkpoint_the_metrics_its_training_run_logged(tmp_path):
    torchrun(*train_args(tmp_path, "eval.every=20", "checkpoint.every_steps=20", "train.max_steps=40"))
    logged = {e["step"]: e for e in records.of_kind(read_metrics(tmp_path / "smoke"), records.EVAL)}
    run_dir = tmp_path / "smoke"
    # the run directory's latest checkpoint, on 2 ranks as it was trained: the same sums, bit for bit
    torchrun("-m", f"{PACKAGE}.tools.evaluate", str(run_dir))
    same_world = json.loads((run_dir / "evaluations" / "step_00000040.json").read_text())
    metrics = [key for key in logged[40] if key.startswith("eval_")]
    assert {key: same_world[key] for key in metrics} == {key: logged[40][key] for key in metrics}
    # an earlier checkpoint on one process: other batches, the same samples each counted once
    one = run([sys.executable, "-m", f"{PACKAGE}.tools.evaluate", str(run_dir / "checkpoints" / "step_00000020.pt")])
    alone = json.loads((run_dir / "checkpoints" / "step_00000020.eval.json").read_text())
    assert "eval step 20 | epoch 0 |" in one.stdout and alone["eval_samples"] == logged[20]["eval_samples"]
    assert {key: alone[key] for key in metrics} == pytest.approx({key: logged[20][key] for key in metrics}, rel=1e-5)


@pytest.mark.slow
def test_compile_really_compiles_and_checkpoints_have_no_prefix(tmp_path):
    from torch._dynamo.utils import counters

    cfg = config.load(None, ["train.compile=true", "train.precision=fp32"])
    info = DistInfo.from_env()
    raw = build_model(cfg)
    model = train.wrap(raw, cfg, info)
    train_set, _ = task.build_datasets(cfg)
    batch = default_collate([train_set[i] for i in range(4)])
    counters.clear()
    task.loss_sum(model, batch).backward()
    assert counters["stats"]["unique_graphs"] >= 1  # a graph was captured, not silently run eager
    assert model._orig_mod is raw and unwrap(model) is raw  # the compiled module wraps the one checkpoints read
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in raw.state_dict())
    build_model(cfg).load_state_dict(raw.state_dict())


def test_bf16_on_an_unsupported_gpu_is_a_config_error(monkeypatch):
    cfg = config.load(None, ["train.precision=bf16"])
    cuda_info = DistInfo(0, 0, 1, 1, torch.device("cuda", 0), "none")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    volta = SimpleNamespace(name="Tesla V100-SXM2-32GB", major=7, minor=0, uuid="GPU-a")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: volta)
    with pytest.raises(config.ConfigError, match="use train.precision=fp16"):
        train.check_settings(cfg, cuda_info.device)


@needs_cuda
def test_cuda_run_binds_its_device_and_uses_nccl(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    result = torchrun(*train_args(tmp_path, "train.max_steps=10"), nproc=nproc, timeout=300)
    backend = "nccl" if nproc > 1 else "none"  # a world of one has no process group
    assert f"backend {backend}, device cuda:0" in result.stdout


@needs_two_gpus
def test_sync_batchnorm_is_converted_before_ddp_on_gpus(tmp_path):
    result = torchrun(
        "-m",
        f"{PACKAGE}.tools.smoke",
        "--config",
        str(PROJECT / "configs" / "smoke.yaml"),
        "parallel.sync_batchnorm=true",
        timeout=300,
    )
    assert "PASS  SyncBatchNorm" in result.stdout


@needs_cuda
def test_fp16_grad_scaler_on_cuda(tmp_path):
    run([sys.executable, *train_args(tmp_path, "train.precision=fp16", "train.max_steps=20")], timeout=300)
    state = checkpoint.load_file(tmp_path / "smoke" / "checkpoints" / "step_00000020.pt")
    assert state["scaler"]["scale"] > 0


@pytest.mark.slow
def test_the_generated_default_config_trains(tmp_path):
    """configs/default.yaml holds the prompted precision, accumulation, compile and SyncBN choices."""
    default = PROJECT / "configs" / "default.yaml"
    tree = yaml.safe_load(default.read_text())
    del tree["dataset"], tree["model"]  # the task's test-sized defaults: a real run's size is not the point here
    light = tmp_path / "default.yaml"
    light.write_text(yaml.safe_dump(tree))
    result = torchrun(
        "-m",
        f"{PACKAGE}.train",
        "--config",
        str(light),
        f"run.out_dir={tmp_path}",
        "train.max_steps=12",
        "run.log_every=4",
        timeout=600,
    )
    cfg = config.load(default)
    assert f"precision {cfg.train.precision}, compile {cfg.train.compile}" in result.stdout
    assert f"x {cfg.train.grad_accum_steps} accumulation steps" in result.stdout
    assert "done: 12 steps" in result.stdout
    assert f"eval {task.MAIN_METRIC[0]}: best" in result.stdout


@pytest.mark.usefixtures("process_settings")
@pytest.mark.parametrize("flag", [True, False])
def test_cudnn_benchmark_follows_the_config(flag):
    cfg = config.load(SMOKE_CONFIG, [f"train.cudnn_benchmark={str(flag).lower()}"])
    train.build(cfg, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none"))
    assert torch.backends.cudnn.benchmark is flag


def test_the_terms_check_counts_the_samples_a_smaller_micro_batch_holds(monkeypatch):
    # a proof of the user's own calls the step on 8 samples where data.batch_size is 16
    monkeypatch.setattr(task, "TERMS_PER_SAMPLE", 2)
    smaller = [torch.zeros(8, 3)]
    train.step_terms(16.0, 16, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none"), smaller)  # 2 for each of 8: right
    with pytest.raises(preflight.TaskError, match="count_terms gave 15 terms for 8 samples, but task.TERMS_PER_SAMPLE"):
        train.step_terms(15.0, 16, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none"), smaller)


@pytest.mark.usefixtures("process_settings")
def test_the_step_frees_the_gradients(monkeypatch):
    stand_ins.install("plain", monkeypatch)  # the loop's step, the same whatever the model
    cfg = config.load(SMOKE_CONFIG)
    job = train.build(cfg, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none"))
    train.train_step(job, [next(iter(job.train_loader))], cfg, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none"))
    assert all(p.grad is None for p in job.model.parameters())  # set_to_none=True


@pytest.mark.parametrize("norm, noted", [(torch.nn.BatchNorm1d(4), True), (torch.nn.LayerNorm(4), False)])
def test_the_unused_sync_batchnorm_note_is_only_for_models_with_batchnorm(capsys, norm, noted):
    cfg = config.load(SMOKE_CONFIG, ["parallel.sync_batchnorm=true"])
    train.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), norm), cfg, DistInfo(0, 0, 1, 1, torch.device("cpu"), "none"))
    assert ("parallel.sync_batchnorm is on but unused" in capsys.readouterr().out) is noted


@pytest.mark.usefixtures("process_settings")
def test_rerunning_a_finished_run_says_so_and_leaves_its_files_as_they_were(tmp_path, capsys):
    overrides = [f"run.out_dir={tmp_path}", "train.max_steps=4", "run.tensorboard=false"]
    cfg = config.load(SMOKE_CONFIG, overrides)
    world_of_one = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
    job = train.build(cfg, world_of_one)
    job.state.step = 4
    train.save_checkpoint(job, cfg, world_of_one)  # the last checkpoint of a finished run
    files = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    capsys.readouterr()
    previous = signal.getsignal(preemption.WORKER_STOP_SIGNAL)  # in case train.main traps it
    try:
        assert train.main(["--config", SMOKE_CONFIG, *overrides]) == 0
    finally:
        signal.signal(preemption.WORKER_STOP_SIGNAL, previous)
    out = capsys.readouterr().out
    assert f"nothing to train: {tmp_path / 'smoke'} is at step 4, and train.epochs / train.max_steps plan 4" in out
    assert "run.name=NEW" in out and "done:" not in out
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == files


@pytest.mark.parametrize(("precision", "per_param"), [("fp32", 16), ("bf16", 20), ("fp16", 20)])
def test_static_memory_counts_weights_gradients_adam_moments_and_amp_copies(precision, per_param):
    cfg = config.load(SMOKE_CONFIG, [f"train.precision={precision}"])
    model = torch.nn.Linear(1000, 1000, bias=False)  # 1,000,000 parameters
    # P28: DDP holds all of it; AdamW's step count is 4 bytes a parameter tensor
    assert parallel.static_memory_bytes(model, [], cfg, 8) == 1_000_000 * per_param + 4
    sgd = config.load(SMOKE_CONFIG, [f"train.precision={precision}", "optim.name=sgd"])
    assert parallel.static_memory_bytes(model, [], sgd, 8) == 1_000_000 * (per_param - 4)  # one momentum buffer


def test_the_start_up_names_the_lr_scaling_rule_and_how_to_turn_it_off():
    sgd = config.load(SMOKE_CONFIG, ["optim.name=sgd", "optim.lr=0.1", "optim.reference_batch_size=32"])
    assert startup.lr_line(sgd.optim, 0.2, 64) == (
        "lr 0.2: optim.lr 0.1 tuned at batch 32, scaled linear (optim.lr_scaling=auto for sgd) to the global "
        "batch 64; optim.lr_scaling=none keeps 0.1"
    )
    assert startup.lr_line(config.load(SMOKE_CONFIG, ["optim.lr_scaling=none"]).optim, 0.01, 64).endswith("not scaled)")


def test_the_start_up_names_sgds_momentum_and_whether_it_warms_up():
    sgd = config.load(SMOKE_CONFIG, ["optim.name=sgd"])
    assert startup.optimizer_text(sgd.optim) == "sgd optimizer (momentum 0.9)"  # torch's own default is 0
    nesterov = config.load(SMOKE_CONFIG, ["optim.name=sgd", "optim.momentum=0.5", "optim.nesterov=true"])
    assert startup.optimizer_text(nesterov.optim) == "sgd optimizer (momentum 0.5, Nesterov)"
    assert startup.optimizer_text(config.load(SMOKE_CONFIG).optim) == "adamw optimizer (betas 0.9, 0.999)"
    assert startup.warmup_text(0.0) == "no warmup (schedule.warmup_fraction=0)"
    assert startup.warmup_text(0.01) == "warmup 1.0% of the steps"


def test_the_start_up_names_the_epochs_when_they_end_the_run_before_max_steps():
    capped = config.load(SMOKE_CONFIG, ["train.epochs=1", "train.max_steps=300"])
    assert startup.planned_steps(capped.train, 217) == "217 steps (train.epochs=1 ends before train.max_steps=300)"
    assert startup.planned_steps(config.load(SMOKE_CONFIG, ["train.max_steps=60"]).train, 60) == "60 steps"


@pytest.mark.usefixtures("process_settings")
@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ("parallel.strategy=fsdp", "parallel.cpu_offload=true"),
            "config error: parallel.cpu_offload: moves GPU state",
        ),
        (
            ("parallel.strategy=fsdp", "train.precision=fp16"),
            "config error: train.precision: fp16 under parallel.strategy",
        ),
        (("checkpoint.format=full", "checkpoint.async_save=true"), "config error: checkpoint.async_save: writes"),
    ],
    ids=["cpu-offload-without-a-gpu", "fsdp-in-fp16", "async-full-checkpoints"],
)
def test_settings_this_machine_or_each_other_refuse_stop_the_run_with_one_line_before_it_starts(
    tmp_path, capsys, overrides, line
):
    if "parallel.strategy=fsdp" in overrides and parallel.floor_problem():
        pytest.skip(parallel.floor_problem())
    with pytest.raises(SystemExit) as stopped:
        train.main(["--config", SMOKE_CONFIG, f"run.out_dir={tmp_path}", "data.num_workers=0", *overrides])
    errors = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and len(errors) == 1 and errors[0].startswith(line), errors
    assert not (tmp_path / "smoke").exists()  # nothing started


def test_cpu_offload_runs_the_process_group_with_gloo_beside_nccl():
    on_gpus = DistInfo(0, 0, 2, 2, torch.device("cuda", 0), "nccl")
    offload = config.load(SMOKE_CONFIG, ["parallel.strategy=fsdp", "parallel.cpu_offload=true"])
    assert parallel.with_backend(offload, on_gpus).backend == "cpu:gloo,cuda:nccl"  # clipping's norm, the CPU step
    for unchanged in (config.load(SMOKE_CONFIG, ["parallel.strategy=fsdp"]), config.load(SMOKE_CONFIG)):
        assert parallel.with_backend(unchanged, on_gpus) == on_gpus
