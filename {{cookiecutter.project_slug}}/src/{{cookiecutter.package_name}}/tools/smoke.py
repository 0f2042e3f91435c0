"""The multi-GPU acceptance check: is DDP wired correctly on this machine, for the run you configured?

    scripts/smoke.sh                  # configs/default.yaml on every local GPU (2 CPU processes without)
    scripts/smoke.sh --config configs/smoke.yaml                 # the tiny run the tests use: the quick check
    torchrun --standalone --nproc_per_node=4 -m {{ cookiecutter.package_name }}.tools.smoke

Trains a few steps of the configured model on the configured data in the configured precision
(only SMOKE_RUN's settings change: the length, evaluation size and timeout), with the project's
own code, evaluates once at the end, and prints a PASS/FAIL/SKIP table on rank 0; exits 1 if any
check fails. Every check runs on every rank (they gather results), so a failure never leaves a
rank waiting in a collective.

Without a GPU it says at once that the run it checks was planned for GPUs, and names the quick
check; after the first forward and backward it estimates the whole. Ctrl-C stops it at once
(it has nothing to save), with one line and the launcher's exit status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

from .. import config, task, train
from ..base import dist, hardware, preemption, records
from ..base.batching import elements, unwrap
from ..base.dist import DistInfo
from ..base.rules import exit_on_user_error
from ..loop import checkpoint, loaders, parallel
from ..loop.metrics import duration_text
from . import checks
from .checks import FAIL, INFO, PASS, SKIP


def digest(tensors) -> str:
    """Exact fingerprint of tensors (bitwise, not approximate); a sharded tensor's is that of the
    whole, which every rank gathers (so every rank must call this)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        if tensor is not None:
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            hasher.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


def parameter_digest(model: torch.nn.Module) -> str:
    # parameters only: BatchNorm running stats legitimately differ per rank (local batches)
    return digest(p for p in model.parameters())


def gradient_digest(model: torch.nn.Module) -> str:
    return digest(p.grad for p in model.parameters())


class CommCounter:
    """Bucket all-reduces seen by DDP's comm hook, grouped by the backward pass that sent them."""

    def __init__(self):
        self.pending = 0
        self.buckets_per_sync: list[int] = []

    @property
    def syncs(self) -> int:
        """All-reducing backward passes: each ends with DDP's last bucket."""
        return len(self.buckets_per_sync)


def counting_allreduce_hook(counter: CommCounter, bucket):
    """DDP comm hook: count the bucket, then all-reduce it as DDP would."""
    counter.pending += 1
    if bucket.is_last():
        counter.buckets_per_sync.append(counter.pending)
        counter.pending = 0
    return default_hooks.allreduce_hook(None, bucket)


def check_devices(info: DistInfo) -> tuple[str, str]:
    """Where each rank computes, as CUDA reports it (current device, GPU UUID), not as LOCAL_RANK implies."""
    identities = dist.all_gather_objects(hardware.device_identity(info.device))
    if info.device.type != "cuda":
        return SKIP, "CPU run: no GPUs to bind (one process per GPU is checked on GPU machines)"
    problems = hardware.device_problems(identities)
    if problems:
        return FAIL, "; ".join(problems)
    return PASS, f"{len(identities)} ranks on {len(identities)} distinct GPUs, each on its own device (CUDA's view)"


def check_backend(info: DistInfo) -> tuple[str, str]:
    expected = info.backend if "," in info.backend else "nccl" if info.device.type == "cuda" else "gloo"
    if not info.distributed:
        return SKIP, "a world of one has no process group; launch with torchrun"
    actual = torch.distributed.get_backend()
    return (PASS if actual == expected else FAIL), f"{actual} (expected {expected} on {info.device.type})"


def check_gradients_reduced(job: train.Job, cfg, info: DistInfo, passes: list[float]) -> tuple[str, str]:
    """Each rank's first batch of the user's own loader differs; after backward every rank must
    hold the same gradients. Appends the seconds of each forward and backward to `passes`."""
    if not info.distributed:
        return SKIP, "a world of one has nothing to all-reduce"
    batch = task.to_device(next(iter(job.train_loader)), info.device)
    model = job.model
    if dist.sharded(model):
        return check_gradients_reduce_scattered(model, batch, cfg, info, passes)
    start = time.perf_counter()
    with model.no_sync():
        with hardware.autocast(cfg.train.precision, info.device):  # the run's precision: the passes time its steps
            loss = task.loss_sum(model, batch)
        loss.backward()
    local = dist.all_gather_objects(gradient_digest(model))  # a digest reads the gradients: the pass has ended
    passes.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with hardware.autocast(cfg.train.precision, info.device):
        loss = task.loss_sum(model, batch)
    loss.backward()
    reduced = dist.all_gather_objects(gradient_digest(model))
    passes.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    if len(set(local)) == 1:
        return FAIL, "local gradients were already equal: the ranks did not get different data"
    if len(set(reduced)) != 1:
        return FAIL, "gradients differ across ranks after backward: they were not all-reduced"
    return PASS, f"each rank's own batch gave identical gradients on {info.world_size} ranks"


def check_gradients_reduce_scattered(model, batch, cfg, info: DistInfo, passes: list[float]) -> tuple[str, str]:
    """Under FSDP each rank keeps its shard of the averaged gradient: the ranks' losses on their
    own batches differ, and every parameter gets a finite gradient shard on every rank."""
    start = time.perf_counter()
    with hardware.autocast(
        cfg.train.precision, info.device
    ):  # parameters gathered in bf16 meet BatchNorm's fp32 outputs
        loss = task.loss_sum(model, batch)
    loss.backward()
    losses = dist.all_gather_objects(loss.item())
    passes.append(time.perf_counter() - start)
    shards = [p.grad for p in model.parameters()]
    complete = dist.all_gather_objects(all(g is not None and bool(g.to_local().isfinite().all()) for g in shards))
    model.zero_grad(set_to_none=True)
    if len(set(losses)) == 1:
        return FAIL, "the ranks' losses were equal: the ranks did not get different data"
    if not all(complete):
        return FAIL, "a rank holds no gradient shard for some parameter, or a non-finite one"
    return PASS, f"each rank's own batch reduce-scattered into gradient shards on {info.world_size} ranks"


def check_precision(cfg, info: DistInfo, scaler) -> tuple[str, str]:
    expected = hardware.AUTOCAST_DTYPES[cfg.train.precision]
    with hardware.autocast(cfg.train.precision, info.device):
        out = torch.nn.functional.linear(torch.ones(2, 2, device=info.device), torch.ones(2, 2, device=info.device))
    scaler_ok = scaler.is_enabled() == (cfg.train.precision == "fp16")
    if out.dtype != expected or not scaler_ok:
        return FAIL, f"matmul ran in {out.dtype}, GradScaler enabled={scaler.is_enabled()} for {cfg.train.precision}"
    scale = f", loss scale {scaler.get_scale():g}" if scaler.is_enabled() else ", no GradScaler (not needed)"
    return PASS, f"{cfg.train.precision}: autocast matmul in {out.dtype}{scale}"


def check_sync_batchnorm(cfg, info: DistInfo, model) -> tuple[str, str]:
    if not cfg.parallel.sync_batchnorm:
        return SKIP, "parallel.sync_batchnorm is off"
    if info.device.type != "cuda" or not info.distributed:
        return SKIP, "SyncBatchNorm needs CUDA and more than one process"
    if not train.has_batchnorm(model):
        return SKIP, "the model has no BatchNorm layer"
    if train.has_batchnorm(model, sync=True):
        return PASS, "BatchNorm layers are SyncBatchNorm"
    return FAIL, "no SyncBatchNorm layer found"


def with_one_evaluation(cfg: config.Config) -> config.Config:
    """`cfg` evaluating once, at the end of its train.max_steps: eval.every=null evaluates at
    each epoch's end too, and a small training set ends several epochs within the steps."""
    if cfg.eval.every is not None or cfg.train.max_steps is None:
        return cfg
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, every=cfg.train.max_steps))


def run_checks(cfg, info: DistInfo, quick: bool = False) -> list[checks.Row]:
    """Every check's row; `quick`: the run checked is the quick one (no other to suggest)."""
    results = {"device per rank": check_devices(info), "backend": check_backend(info)}
    cfg = with_one_evaluation(cfg)
    job = train.build(cfg, info)
    cut = bound_evaluation(job, cfg, info)
    counter = CommCounter()
    if isinstance(job.model, DDP):
        job.model.register_comm_hook(counter, counting_allreduce_hook)
    passes: list[float] = []
    results["gradients all-reduced"] = check_gradients_reduced(job, cfg, info, passes)
    if passes:
        dist.print0(info, estimate_line(passes[-1], job, cfg, quick))
    start = time.perf_counter()
    with train.training_log(job, cfg, info) as log:
        train.fit(job, cfg, info, log, preemption.PreemptionFlag(signals=()))
    elapsed = time.perf_counter() - start

    digests = dist.all_gather_objects(parameter_digest(job.model))
    same = len(set(digests)) == 1
    results["parameters equal on all ranks"] = (PASS if same else FAIL, f"digests {sorted(set(digests))}")
    logged = records.read(cfg.run_dir.metrics) if info.is_main else []
    results["loss decreases"] = dist.broadcast_object(_loss_trend(logged))
    results["one all-reduce per optimizer step"] = _comm_check(counter, job, info)
    results["precision"] = check_precision(cfg, info, job.state.scaler)
    results["SyncBatchNorm"] = check_sync_batchnorm(cfg, info, job.model)
    results["checkpoint round trip"] = _checkpoint_round_trip(job, cfg, info)
    results["eval counts every sample once"] = _eval_count(logged, job, info, cut)
    samples = job.state.step * job.global_batch
    speed = log.speed_text(log.speed(samples / elapsed))
    results["throughput"] = (INFO, f"{speed} over {job.state.step} steps, evaluation and checkpoints included")
    results["peak memory per device"] = (INFO, _peak_memory(info))
    # checks gather what they need from every rank; rank 0's verdicts decide everyone's exit code
    return dist.broadcast_object([(verdict, name, detail) for name, (verdict, detail) in results.items()])


QUICK_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml"  # the tests' tiny run
QUICK_COMMAND = "scripts/smoke.sh --config configs/smoke.yaml"
QUICK_ENOUGH_S = 120  # a longer check names the quick one beside its estimate


def is_quick(files: list[str]) -> bool:
    """Whether the check runs the quick config: the tests' tiny run, seconds on a CPU."""
    return any(Path(path).resolve() == QUICK_CONFIG for path in files)


def planned_note(cfg, info: DistInfo, quick: bool) -> str | None:
    """Said at once where no GPU runs what the project was planned for GPUs to run: the check will
    be slow, an estimate follows, and the quick check is the other choice. None on a GPU, or when
    the check is already the quick one."""
    if info.device.type == "cuda" or quick:
        return None
    planned = os.environ.get("PLANNED_GPUS_PER_NODE")  # set by scripts/*.sh: the GPUs of the project's plan
    plan = f"planned for {planned} GPU(s) a node" if planned else "planned for GPUs"
    precision = cfg.train.precision
    emulated = f" in {precision}, which a CPU without {precision} units emulates" if precision != "fp32" else ""
    return (
        f"smoke: no GPU here: checking the configured run ({plan}) on {info.world_size} CPU process(es){emulated}; "
        f"an estimate of its length follows the first step. The quick check on a CPU: {QUICK_COMMAND}"
    )


def estimate_line(seconds_per_pass: float, job: train.Job, cfg, quick: bool) -> str:
    """The check's length, foreseen from one forward and backward of the gradient check (a step
    makes train.grad_accum_steps of them); when long, the quick check beside it."""
    steps = job.total_steps
    seconds = seconds_per_pass * cfg.train.grad_accum_steps * steps
    line = (
        f"smoke: one forward and backward took {duration_text(seconds_per_pass)}: the {steps} steps take about "
        f"{duration_text(seconds)}, then an evaluation and the checks"
    )
    if not quick and seconds > QUICK_ENOUGH_S:
        line += f"; to take the quick check instead: Ctrl-C, then {QUICK_COMMAND}"
    return line


def _loss_trend(logged: list[dict]) -> tuple[str, str]:
    losses = [r["loss"] for r in records.of_kind(logged, records.TRAIN)]
    if len(losses) < 2:
        return FAIL, "fewer than two loss records: raise train.epochs or lower run.log_every"
    verdict = PASS if losses[-1] < losses[0] else FAIL
    return verdict, f"{losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} log windows"


def _comm_check(counter: CommCounter, job: train.Job, info: DistInfo) -> tuple[str, str]:
    if dist.sharded(job.model):
        return SKIP, "parallel.strategy=fsdp gathers and reduce-scatters per unit; tests/dist_proofs.py proves its sums"
    if not isinstance(job.model, DDP):
        return SKIP, "a world of one has no gradient communication"
    expected = job.state.step + 1  # the gradient check made one all-reducing backward
    detail = f"{counter.syncs} all-reducing backward passes for {job.state.step} optimizer steps + 1 check"
    return (PASS if counter.syncs == expected else FAIL), detail


def _checkpoint_round_trip(job: train.Job, cfg, info: DistInfo) -> tuple[str, str]:
    """Rank 0's weights are the checkpoint's (a file gathered to it, or every rank's part with its
    buffers); only its comparison is meaningful."""
    path = train.save_checkpoint(job, cfg, info, final=True)  # written, also with checkpoint.async_save
    fresh = task.build_model(cfg)
    fresh.load_state_dict(checkpoint.find(path)[1]["model"])
    same = digest(fresh.state_dict().values()) == digest(unwrap(job.model).state_dict().values())
    return (PASS if same else FAIL), f"{path.name} reloads into a plain model bit-identically"


def bound_evaluation(job: train.Job, cfg, info: DistInfo) -> str:
    """Evaluation samples larger than training samples (a long stream each, say) count for as many
    training samples as they hold elements, so that eval.limit bounds what the evaluation
    costs rather than only its samples: `job` then evaluates the first of them that hold about as
    much as eval.limit training samples, at least one a rank. Returns what was cut, or ""."""
    eval_set = job.eval_loader.dataset
    ratio = elements(eval_set[0]) / max(1, elements(job.train_loader.dataset[0]))
    limit = cfg.eval.limit or len(eval_set)
    keep = max(info.world_size, int(limit / ratio))
    if keep >= len(eval_set):
        return ""
    shorter, workers = Subset(eval_set, range(keep)), job.eval_loader.num_workers
    job.eval_loader = loaders.build_loaders(job.train_loader.dataset, shorter, cfg, info, workers)[1]
    return (
        f"; each holds {ratio:.0f}x a training sample's elements: the first {keep}, "
        f"as much as {limit} training samples (eval.limit)"
    )


def _eval_count(logged: list[dict], job: train.Job, info: DistInfo, cut: str) -> tuple[str, str]:
    """The samples the run's evaluation counted (rank 0's log; rank 0's verdict is everyone's),
    against the evaluation set."""
    evaluations = records.of_kind(logged, records.EVAL)
    if not evaluations:
        return FAIL, "the run wrote no evaluation"
    counted, expected = evaluations[-1][records.EVAL_SAMPLES], len(job.eval_loader.dataset)
    verdict = PASS if counted == expected else FAIL
    return verdict, f"{counted} of {expected} samples on {info.world_size} ranks{cut}"


def _peak_memory(info: DistInfo) -> str:
    if info.device.type != "cuda":
        return "n/a on CPU"
    peaks = dist.all_gather_objects(torch.cuda.max_memory_allocated(info.device) / 2**20)
    return ", ".join(f"rank {i}: {mib:.0f} MiB" for i, mib in enumerate(peaks))


# the smoke check's own run on top of the config (your overrides come after): a few steps, a
# checkpoint mid-run and one at the end, an evaluation of the first samples, a short timeout
SMOKE_RUN = [
    "run.name=smoke-check",
    "checkpoint.resume=never",
    "train.max_steps=40",
    "run.log_every=5",
    "checkpoint.every_steps=20",
    "eval.every=null",  # evaluates at the end only (with_one_evaluation)
    "eval.limit=512",  # samples, or fewer larger ones (bound_evaluation)
    "dist.timeout_minutes=5",
    "run.trackers=[]",
]


def settings(files: list[str], overrides: list[str]) -> config.Config:
    """The smoke check's run: `files` (config.files' list), its own settings, then `overrides`."""
    return composed(files, overrides)[0]


def composed(files: list[str], overrides: list[str]) -> tuple[config.Config, config.Sources]:
    """`settings`, and where each of the user's settings was given."""
    return config.compose(files, overrides, preset=SMOKE_RUN)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_config_option(parser, "the run to check (yours by default)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    info = DistInfo.from_env()
    files = config.files(args.config)
    with exit_on_user_error():
        cfg, sources = composed(files, args.overrides)
        dist.bind_device(info)  # first: a CUDA query from an unbound rank opens a context on GPU 0
        train.check_settings(cfg, info.device, sources)  # as the run checks them: the round trip saves as it would
    info = parallel.with_backend(cfg, info)
    quick = is_quick(files)
    note = planned_note(cfg, info, quick)
    if note:
        dist.print0(info, note)
    signal.signal(preemption.WORKER_STOP_SIGNAL, stop_now)  # the launcher's stop: Ctrl-C, a TERM
    return dist.run_in_group(info, cfg.dist.timeout_minutes, lambda: smoke(cfg, info, quick))


def stop_now(signum, frame) -> None:
    """The node launcher's stop signal (it turns a Ctrl-C into this on every rank): a smoke check
    has nothing to save, so the rank leaves at once, reporting the stop as a preempted run does.
    The launcher then exits 130 after a Ctrl-C. Every rank gets the signal; a peer still in a
    collective with this one sees its connection close and gets it too."""
    code = preemption.report_preemption()
    if os.environ.get("RANK", "0") == "0":
        print("smoke: stopped on request before its checks ended; nothing to save", flush=True)
    sys.stderr.flush()
    os._exit(code)


def smoke(cfg: config.Config, info: DistInfo, quick: bool = False) -> int:
    if info.is_main:
        shutil.rmtree(cfg.run_dir.root, ignore_errors=True)  # a clean run directory every time
    dist.barrier()
    with parallel.unreduced_parameters_named():
        results = run_checks(cfg, info, quick)
    dist.print0(info, checks.table("smoke", results))
    return checks.exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
