"""Diagnostics for the usual DDP pitfalls.

    python -m {{ cookiecutter.package_name }}.tools.diagnose doctor    # versions, GPUs, ports, CPUs, /dev/shm
    python -m {{ cookiecutter.package_name }}.tools.diagnose unused    # parameters that get no gradient
    python -m {{ cookiecutter.package_name }}.tools.diagnose scaling   # speedup and time split, 1 vs N processes
    python -m {{ cookiecutter.package_name }}.tools.diagnose memory    # does it fit? four figures, ddp vs fsdp
Each takes --config and section.key=value overrides like training does. `unused` and `memory`
call task.loss_sum with the model in train mode, as training does (the seam's contract).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from .. import config, task
from ..base import batching, cpus, hardware, processes, records
from ..base.dist import DistInfo
from ..base.hardware import Gpu
from ..base.rules import ConfigError, exit_on_user_error
from ..base.rundir import RunDir
from ..config import Config, DataConfig
from ..loop import loaders, parallel
from ..loop.profiling import SPLIT
from . import checks, launch, saved_activations
from .checks import FAIL, PASS, WARN

INTERESTING_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TORCH_DISTRIBUTED_DEBUG", "GLOO_SOCKET_IFNAME")

PROJECT_PACKAGE = __package__.rpartition(".")[0]  # the package above tools/


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def doctor(cfg: Config, nproc: int | None, ports: list[int]) -> list[tuple[str, str, str]]:
    """(verdict, topic, detail) rows about this machine for this config."""
    python = f"{platform.python_version()} on {platform.machine()}"
    rows = [(PASS, "python", python), (PASS, "torch", torch.__version__)]
    found = hardware.gpus()  # counted as the launcher counts them (CUDA's view), with their capabilities
    if found:
        rows.append((PASS, "cuda", str(torch.version.cuda)))
    rows += gpu_rows(cfg.train.precision, found, hardware.nccl_version(), cfg.dist.gpus_per_node)
    ranks = nproc or len(found) or launch.CPU_PROCESSES
    for port in ports:
        if port_is_free(port):
            rows.append((PASS, f"port {port}", "free"))
        else:
            rows.append(
                (
                    WARN,
                    f"port {port}",
                    "busy: another job holds it; use scripts/train.sh (picks a free "
                    "port) or set MASTER_PORT to a free one",
                )
            )
    rows += cpu_rows(cfg.data, ranks)
    rows.append(shm_row())
    for name in sorted(k for k in os.environ if k.startswith("NCCL_") or k in INTERESTING_ENV):
        rows.append((PASS, "env", f"{name}={os.environ[name]}"))
    return rows


def gpu_rows(precision: str, found: list[Gpu], nccl: str | None, planned: int) -> list[tuple[str, str, str]]:
    """(verdict, topic, detail) rows about the GPUs for `diagnose doctor`."""
    launch = f"{len(found)} visible (the count the launch scripts use), project planned for {planned} per node"
    if not found:
        return [(WARN if planned else PASS, "GPUs", launch + " (CPU runs use gloo; the scripts start 2 processes)")]
    rows = [(PASS if len(found) == planned else WARN, "GPUs", launch)]
    rows.append((PASS, "NCCL", nccl) if nccl else (FAIL, "NCCL", "this torch build has no NCCL: install a CUDA build"))
    for gpu in found:
        rows.append(_capability_row(precision, gpu))
    mig = [gpu.index for gpu in found if gpu.is_mig]
    if mig:
        # CUDA shows a process one MIG instance, and NCCL cannot connect instances to each other
        rows.append((WARN, "MIG", f"GPU(s) {mig} are MIG instances: train with one process (NPROC_PER_NODE=1)"))
    return rows


def _capability_row(precision: str, gpu: Gpu) -> tuple[str, str, str]:
    major, minor = gpu.capability
    detail = f"{gpu.name}, compute capability {major}.{minor}"
    if precision == "bf16" and not hardware.bf16_native(gpu.capability):
        return FAIL, f"GPU {gpu.index}", detail + ": bf16 is emulated here; use train.precision=fp16"
    if precision == "fp16" and tuple(gpu.capability) < hardware.FP16_TENSOR_CORES:
        return WARN, f"GPU {gpu.index}", detail + ": no tensor cores, fp16 brings little; fp32 is as fast"
    return PASS, f"GPU {gpu.index}", detail + f": {precision} runs natively"


def cpu_rows(data: DataConfig, ranks: int) -> list[tuple[str, str, str]]:
    available = cpus.cpus_available()
    auto = loaders.workers_per_rank(available, ranks, data.max_workers)
    workers = loaders.resolve_workers(data, available, ranks)
    started = ranks * (workers + 1)
    verdict = PASS if started <= available else WARN
    rows = [
        (
            verdict,
            "CPU workers",
            f"{ranks} ranks x ({workers} loader workers + 1) = {started} processes on {available} CPUs"
            + ("" if verdict == PASS else f"; oversubscribed: use data.num_workers=auto ({auto})"),
        )
    ]
    threads = cpus.threads_per_rank(os.environ, ranks)  # what training will use
    verdict = PASS if threads * ranks <= available else WARN
    rows.append((verdict, "CPU threads", f"{threads} per rank x {ranks} ranks on {available} CPUs"))
    return rows


def shm_row() -> tuple[str, str, str]:
    """Loader workers hand batches over through /dev/shm; docker's default 64 MiB is too small."""
    if not Path("/dev/shm").exists():
        return PASS, "/dev/shm", "absent (not Linux); loader workers use other shared memory"
    free_gib = shutil.disk_usage("/dev/shm").free / 2**30
    verdict = PASS if free_gib >= 1 else WARN
    hint = "" if verdict == PASS else "; loader workers may crash with 'bus error': raise it (docker --shm-size=8g)"
    return verdict, "/dev/shm", f"{free_gib:.1f} GiB free{hint}"


def unused_parameters(cfg: Config, model: torch.nn.Module) -> list[str]:
    """Names of parameters whose .grad is None after one plain (non-DDP) step on a real batch
    of the training loader, with the task's own loss."""
    _, train_loader = training_loader(cfg)
    model.train()
    return without_gradient(model, next(iter(train_loader)))


def sometimes_unused(cfg: Config, model: torch.nn.Module, never: list[str]) -> list[str]:
    """Names of the parameters, other than `never`, that a step on some pair of the first samples
    leaves without a gradient: a routed model's experts that no token of a small batch chose (a
    rank's batch can leave them without one too)."""
    train_set, train_loader = training_loader(cfg)
    model.train()
    firsts = range(0, min(16, len(train_set)) - 1, 2)
    pairs = [train_loader.collate_fn([train_set[i], train_set[i + 1]]) for i in firsts]
    sometimes = {name for pair in pairs for name in without_gradient(model, pair)} - set(never)
    return [name for name, _ in model.named_parameters() if name in sometimes]


def training_loader(cfg: Config):
    """The training set and its loader, as one process reads them."""
    train_set, eval_set = loaders.datasets(cfg)
    world_of_one = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
    return train_set, loaders.build_loaders(train_set, eval_set, cfg, world_of_one, 0)[0]


def unused_advice(never: list[str], sometimes: list[str], reduced: bool) -> str:
    """What to do about them; `reduced`: ddp with parallel.find_unused_parameters=true, which
    reduces zeros for a parameter that a rank's batch left without a gradient."""
    if never:
        return (
            "parameters without a gradient after one step (freeze them with requires_grad_(False), "
            "remove them, or set parallel.find_unused_parameters=true at a 10-20% cost):"
        )
    routed = "parameters that some batches leave without a gradient (a routed model's experts)"
    if sometimes and reduced:
        return f"{routed}, which parallel.find_unused_parameters=true reduces under ddp:"
    if sometimes:
        return (
            f"{routed}: under ddp set parallel.find_unused_parameters=true; under fsdp every rank must give them "
            "one (pytorch#158719): run each expert on its empty selection instead of skipping it"
        )
    return "every parameter gets a gradient: keep parallel.find_unused_parameters=false"


def without_gradient(model: torch.nn.Module, batch) -> list[str]:
    model.zero_grad(set_to_none=True)
    task.loss_sum(model, batch).backward()
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def load_model_factory(spec: str | None):
    """'module:function' returning a model for a config; the project's build_model by default."""
    if spec is None:
        return task.build_model
    module, _, function = spec.partition(":")
    return getattr(importlib.import_module(module), function)


# torchrun, told to stop (TERM), gives its workers 30 s before it kills them: allow it that long
TORCHRUN_GRACE_SECONDS = 40


class ScalingRunFailed(Exception):
    """A scaling run exited non-zero; its own output says why."""


def scaling(
    cfg_paths: list[str],
    overrides: list[str],
    nproc: int,
    steps: int,
    stop: processes.StopSignals,
    out_dir: str | None = None,
) -> dict:
    """Train `steps` steps on 1 process and on `nproc`, then compare steady-state throughput and
    the split of a step's time. The runs are kept in out_dir (scale1/, scaleN/) when given. Each
    run is a child of ours (processes.run_child): a stop signal ends it and raises Stopped."""
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        out = out_dir or scratch
        for n in (1, nproc):
            window = max(1, steps // 3)
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={n}",
                "-m",
                f"{PROJECT_PACKAGE}.train",
                *(part for path in cfg_paths for part in ("--config", path)),
                *overrides,
                f"run.out_dir={out}",
                f"run.name=scale{n}",
                f"train.max_steps={steps}",
                f"run.log_every={window}",
                "checkpoint.resume=never",
                f"checkpoint.every_steps={steps}",
                "train.epochs=1000",
            ]
            code = processes.run_child(
                command, stop, env=_threads_env(n), grace=TORCHRUN_GRACE_SECONDS, stdout=subprocess.DEVNULL
            )
            if code != 0:
                raise ScalingRunFailed(f"the run on {n} process(es) failed (exit code {code}); its output is above")
            logged = records.read(RunDir(Path(out) / f"scale{n}").metrics)
            steady = records.of_kind(logged, records.TRAIN)[1:]  # the first window holds start-up costs
            keys = ("samples_per_s", "data_wait_share", "step_ms", *SPLIT)
            results[n] = {key: sum(r[key] for r in steady) / len(steady) for key in keys}
    return results


def _threads_env(nproc: int) -> dict:
    """The environment of a run on `nproc` processes: threads per rank as the node launcher sets them."""
    return os.environ | {"OMP_NUM_THREADS": str(cpus.threads_per_rank(os.environ, nproc))}


def scaling_report(results: dict, nproc: int) -> str:
    one, many = results[1], results[nproc]
    speedup = many["samples_per_s"] / one["samples_per_s"]
    efficiency = speedup / nproc
    if efficiency >= 0.9:
        band = "good: communication is hidden behind compute"
    elif efficiency >= 0.7:
        band = "room to improve: see the split below"
    elif efficiency >= 0.6:
        band = "poor: a bottleneck is forming"
    else:
        band = "bottleneck: fix it before adding devices"
    # Each process holds the same per-device batch in both runs, so forward + backward does the
    # same compute; what it takes longer on N processes is the all-reduce backward could not
    # hide, plus contention for shared CPUs and memory.
    comm = max(0.0, many["fwd_bwd_ms"] - one["fwd_bwd_ms"])
    data = many["data_wait_ms"]
    hint = (
        "raise data.num_workers or make loading cheaper"
        if data >= comm
        else "raise per-device batch, grad_accum_steps or parallel.bucket_cap_mb; check the interconnect"
    )
    rows = [f"{'ms per step':<13}{'data wait':>10}{'fwd+bwd':>10}{'optimizer':>10}{'other':>10}{'step':>10}"]
    for n, label in ((1, "1 process"), (nproc, f"{nproc} processes")):
        rows.append(f"{label:<13}" + "".join(f"{results[n][key]:>10.2f}" for key in (*SPLIT, "step_ms")))
    return "\n".join(
        [
            f"1 process:   {one['samples_per_s']:,.0f} samples/s",
            f"{nproc} processes: {many['samples_per_s']:,.0f} samples/s",
            f"speedup {speedup:.2f}x, efficiency {efficiency:.2f} ({band})",
            *rows,
            f"communication and contention on {nproc} processes (their fwd+bwd minus 1 process's): "
            f"{comm:.2f} ms per step, {comm / many['step_ms']:.0%} of the step; data wait {data / many['step_ms']:.0%}",
            f"largest cost beyond compute: {'data' if data >= comm else 'communication'}: {hint}",
        ]
    )


def device_gb() -> float:
    """This machine's first GPU's memory in GB, else an 80 GB card's."""
    return torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available() else 80.0


STATIC = ("weights", "gradients", "optimizer state")  # memory_rows' static parts, in its order


def memory_rows(cfg: Config, model: torch.nn.Module, batch, ranks: int) -> list[tuple]:
    """(strategy, activation checkpointing, weights, gradients, optimizer state, activations), in
    bytes per device on `ranks` devices: the static parts (static_parts), and the most activation
    memory one micro-batch holds for backward, traced on `batch` through task.loss_sum with the
    model in train mode, as training calls it. `model` and `batch` may be fake tensors
    (memory_estimate): any size is measured without its memory."""
    model.train()  # the seam's contract: loss_sum sees train mode (a detector returns its losses only there)
    units, rows = parallel.units(model), []
    for strategy in ("ddp", "fsdp"):
        setting = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy=strategy))
        static = static_parts(model, units, setting, ranks)
        if strategy == "fsdp" and cfg.train.precision in parallel.LOW_PRECISION:
            gathered_in(model, parallel.LOW_PRECISION[cfg.train.precision])  # FSDP's param_dtype
        saved = saved_activations.saved_for_backward(model, batch, units, cfg.train.precision)
        for mode in ("none", "selective", "full"):
            rows.append((strategy, mode, *static, saved.activation_bytes(parallel.recomputed(units, mode))))
    return rows


def static_parts(model: torch.nn.Module, units: list[torch.nn.Module], cfg: Config, ranks: int) -> tuple[int, ...]:
    """parallel.static_memory_bytes in its STATIC parts: the weights (a 1/N share under fsdp, plus
    the units gathered in the precision FSDP gathers them in; under ddp AMP's low-precision copies,
    budgeted at 4 bytes a parameter), the gradients (a share, plus whole fp32 gradients between
    micro-batches without parallel.reduce_every_micro_batch) and the optimizer's state (0 for
    optim.name=task, which it does not count)."""
    shapes = [p.shape for p in model.parameters()]
    params = sum(p.numel() for p in model.parameters())
    low = cfg.train.precision in parallel.LOW_PRECISION
    shards = 1 if cfg.parallel.strategy == "ddp" or ranks == 1 else ranks
    local = [parallel.shard_shape(shape, shards) for shape in shapes]
    share = 4 * sum(math.prod(shape) for shape in local)  # fp32: the weights' share, and the gradients'
    optimizer = parallel.optimizer_state_bytes(local, cfg.optim) or 0
    if shards == 1:
        return share + (4 * params if low else 0), share, optimizer
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units] or [params]
    held = 2 * max(sizes) if cfg.parallel.reshard_after_forward else sum(sizes)
    whole_gradients = cfg.train.grad_accum_steps > 1 and not cfg.parallel.reduce_every_micro_batch
    return share + held * (2 if low else 4), share + (4 * params if whole_gradients else 0), optimizer


def memory_report(cfg: Config, model: torch.nn.Module, batch, ranks: int, gpu_gb: float) -> str:
    """memory_rows in words, and whether each total fits a `gpu_gb` device."""
    units = parallel.units(model)
    params = sum(p.numel() for p in model.parameters())
    state = parallel.optimizer_state_bytes([p.shape for p in model.parameters()], cfg.optim)
    optimizer = f"optim.name={cfg.optim.name}" + ("" if state is not None else " (its state not counted)")
    lines = [
        f"{params:,} parameters, {len(units)} FSDP units; {optimizer}, train.precision={cfg.train.precision}; "
        f"a micro-batch {batching.describe(batch)}",
        f"per device: {' + '.join(STATIC)} + activations held for backward = total",
    ]
    for strategy, mode, *parts in memory_rows(cfg, model, batch, ranks):
        total = sum(parts)
        fits = "yes" if total <= gpu_gb * 1e9 else "no"
        mark = "  <- parallel.activation_checkpointing" if mode == cfg.parallel.activation_checkpointing else ""
        lines.append(
            f"  {strategy} on {ranks}, checkpointing {mode:<9} {' + '.join(map(gb, parts))} = {gb(total)}; "
            f"fits in {gpu_gb:g} GB: {fits}{mark}"
        )
    return "\n".join(lines)


def gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def gathered_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The parameters in the dtype FSDP gathers them in (BatchNorm's stay fp32, as parallel.shard keeps them)."""
    for module in model.modules():
        if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)


class CannotEstimate(ConfigError):
    """A model diagnose memory cannot trace, whatever its settings: one line and exit 2, as a
    ConfigError, under a prefix that does not blame the config."""

    prefix = "cannot estimate"


def memory_estimate(cfg: Config, ranks: int, gpu_gb: float, build=None) -> str:
    """memory_report for the configured model and micro-batch (the training loader's first, of
    data.batch_size samples), the model built on the meta device, then traced on fake tensors:
    shapes and dtypes, no memory for the weights or the activations, at any size."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    _, train_loader = training_loader(cfg)
    batch = task.to_device(next(iter(train_loader)), torch.device("cpu"))
    with torch.device("meta"):
        model = (build or task.build_model)(cfg)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):  # the batch's real tensors become fake where they meet it
            on_fake_cpu(model)
            return memory_report(cfg, model, batch, ranks, gpu_gb)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise CannotEstimate(
            f"the model's forward or task.loss_sum reads its data's values ({type(error).__name__}{seam_line(error)}; "
            "a routed model's choice of experts does), which diagnose memory's trace on fake tensors cannot follow; "
            "measure it instead: the smoke check's peak memory per device, on the GPUs"
        ) from None


def seam_line(error: BaseException) -> str:
    """Where the user's code stands last on `error`'s traceback, as " at task.py:57" (the line that
    reads a value): torch's frames and this package's own loop are passed over; "" when none is left."""
    passed = (Path(torch.__file__).parent, *(Path(task.__file__).parent / part for part in ("base", "loop", "tools")))
    lines = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not any(folder in Path(frame.filename).parents for folder in passed)
    ]
    return f" at {Path(lines[-1].filename).name}:{lines[-1].lineno}" if lines else ""


def on_fake_cpu(model: torch.nn.Module) -> None:
    """Each parameter and buffer of a model built on the meta device replaced by a fake CPU tensor
    of its shape, dtype and strides (inside a FakeTensorMode), a tied parameter by one tensor: the
    model runs as on the CPU, on shapes alone."""
    replaced = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in replaced:
            empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
            is_parameter = isinstance(tensor, torch.nn.Parameter)
            replaced[id(tensor)] = torch.nn.Parameter(empty, tensor.requires_grad) if is_parameter else empty
        return replaced[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = fake(tensor)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["doctor", "unused", "scaling", "memory"])
    config.add_config_option(parser)
    parser.add_argument("--nproc", type=int, default=None, help="processes per node (default: GPUs, else 2)")
    ports = f"ports to check (default 29500 and {launch.DEFAULT_MASTER_PORT})"
    parser.add_argument("--port", type=int, action="append", help=ports)
    parser.add_argument("--model", default=None, help="module:function building the model (default: build_model)")
    parser.add_argument("--steps", type=int, default=60, help="steps per scaling run")
    parser.add_argument("--out", default=None, help="scaling: keep the two runs here (for `report`)")
    parser.add_argument("--gpu-gb", type=float, default=None, help="memory: GB a device (default: this GPU, else 80)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    with exit_on_user_error():
        cfg = config.load(config.files(args.config), args.overrides)
    if args.command == "doctor":
        rows = doctor(cfg, args.nproc, args.port or [29500, launch.DEFAULT_MASTER_PORT])
        print(checks.table("doctor", rows))
        return checks.exit_code(rows)
    if args.command == "memory":
        ranks = args.nproc or cfg.dist.gpus_per_node * cfg.dist.num_nodes
        with exit_on_user_error():
            print(memory_estimate(cfg, ranks, args.gpu_gb or device_gb(), load_model_factory(args.model)))
        return 0
    if args.command == "unused":
        model = load_model_factory(args.model)(cfg)
        never = unused_parameters(cfg, model)
        sometimes = sometimes_unused(cfg, model, never)
        reduced = cfg.parallel.strategy == "ddp" and cfg.parallel.find_unused_parameters
        print(unused_advice(never, sometimes, reduced))
        print("".join(f"  {name}\n" for name in never or sometimes), end="")
        return 1 if never or (sometimes and not reduced) else 0
    nproc = args.nproc or torch.cuda.device_count() or 2
    try:
        paths, stop = config.files(args.config), processes.StopSignals()
        results = scaling(paths, args.overrides, nproc, args.steps, stop, args.out)
    except processes.Stopped as stopped:
        sys.stderr.write(f"diagnose scaling stopped by {stopped}\n")
        return stopped.exit_code
    except ScalingRunFailed as err:
        sys.stderr.write(f"diagnose scaling: {err}\n")
        return 1
    print(scaling_report(results, nproc))
    if args.out:
        print(f"runs kept: python -m {__package__}.report {args.out}/scale1 {args.out}/scale{nproc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
