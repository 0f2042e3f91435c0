"""Shared helpers: run the project's entry points the way users do, bounded in time."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import stand_ins
import torch

from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.config import load as load_config
from {{ cookiecutter.package_name }}.loop import sharded_checkpoint
from {{ cookiecutter.package_name }}.tools import launch

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = "{{ cookiecutter.package_name }}"
SMOKE_CONFIG = str(PROJECT / "configs" / "smoke.yaml")
WORLD_OF_ONE = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")  # the loop's own run in this process
_SHARDED_FLOOR = sharded_checkpoint.floor_problem()
CHECKPOINT_FORMATS = [
    "full",
    pytest.param("sharded", marks=pytest.mark.skipif(bool(_SHARDED_FLOOR), reason=_SHARDED_FLOOR or "")),
]


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the slow tier: fault drills, launchers, swaps")
    parser.addoption(
        "--task",
        action="store_true",
        help="also run the slow tests of the task end to end (its real run, resume, evaluation counts, smoke check)",
    )
    parser.addoption(
        "--fsdp",
        action="store_true",
        help="also run the FSDP proofs and drills on the project's model where configs/default.yaml trains with "
        "ddp: before switching parallel.strategy to fsdp",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "fsdp: runs the project's model sharded (parallel.strategy=fsdp); where configs/default.yaml trains with "
        "ddp, skipped with the reason unless --fsdp is given",
    )


def project_strategy(path: Path = PROJECT / "configs" / "default.yaml") -> str:
    """parallel.strategy as the run reads it from `path` (configs/default.yaml): its files, renamed
    keys and dataclass defaults as the loop loads them."""
    with contextlib.redirect_stderr(io.StringIO()):  # a renamed key's note is the run's to print
        return load_config(str(path)).parallel.strategy


def model_needs(path: Path = PROJECT / "configs" / "default.yaml") -> list[str]:
    """What the project's model needs wherever it trains, read from configs/default.yaml as the run
    reads it, as overrides of the tests' configs/smoke.yaml: DDP's reduction of the parameters that
    a rank's batch leaves without a gradient (a routed model's experts)."""
    with contextlib.redirect_stderr(io.StringIO()):
        find_unused = load_config(str(path)).parallel.find_unused_parameters
    return [f"parallel.find_unused_parameters={str(find_unused).lower()}"]


@pytest.fixture
def plain_task(monkeypatch):
    """The loop's own behaviour, the same whatever the model: the plain stand-in task trains."""
    stand_ins.install("plain", monkeypatch)


@pytest.fixture
def world_of_one():
    """A real process group of one rank, so DDP can wrap a module in this process."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def runs_fsdp(config) -> bool:
    """Whether the tests marked fsdp run: the project trains with fsdp, or --fsdp asks for them."""
    return project_strategy() == "fsdp" or config.getoption("--fsdp")


def pytest_collection_modifyitems(config, items):
    if not runs_fsdp(config):
        skip = pytest.mark.skip(
            reason=f"configs/default.yaml trains with parallel.strategy={project_strategy()}: the FSDP proofs and "
            "drills run where it is fsdp (a model that trains under DDP need not shard); before switching to fsdp, run "
            "them on your model: `python -m pytest --fsdp` (with --slow for the drills)"
        )
        for item in items:
            if item.get_closest_marker("fsdp"):
                item.add_marker(skip)
    if config.getoption("--slow"):
        return
    with_task = config.getoption("--task")
    skip = pytest.mark.skip(reason="slow tier: run `python -m pytest --slow` (or `--task` for the task's tests)")
    for item in items:
        is_task = item.get_closest_marker("task") is not None
        if (is_task or item.get_closest_marker("slow")) and not (is_task and with_task):
            item.add_marker(skip)


@pytest.fixture
def process_settings(monkeypatch):
    """Put back what train.build and train.run set process-wide: threads, cuDNN, the stop signal."""
    from {{ cookiecutter.package_name }}.base import preemption

    threads, handler = torch.get_num_threads(), signal.getsignal(preemption.WORKER_STOP_SIGNAL)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    yield
    torch.set_num_threads(threads)
    signal.signal(preemption.WORKER_STOP_SIGNAL, handler)


def needs_gpus(count: int):
    """Mark a test `gpu` (select with -m gpu) and skip it, saying why, where GPUs are missing."""
    visible = torch.cuda.device_count()
    skip = pytest.mark.skipif(visible < count, reason=f"needs {count} CUDA GPU(s); this machine has {visible}")
    return lambda test: pytest.mark.gpu(skip(test))


needs_cuda = needs_gpus(1)
needs_two_gpus = needs_gpus(2)


def project_env(**extra: str) -> dict:
    """The environment of a launch: the project importable without installing, 1 thread a rank."""
    env = dict(os.environ)
    paths = [str(PROJECT / "src"), str(PROJECT / "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a hang's report holds each process's Python stack
    env.update(extra)
    return env


def run(command: list[str], timeout: float = 120, env: dict | None = None, check: bool = True):
    """Run a command from the project root; a hang fails the test instead of the CI job, and says
    where every process of the launch was."""
    process = subprocess.Popen(
        command,
        cwd=PROJECT,
        env=env or project_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ((returncode, stdout, stderr),) = finish([process], timeout)
    if check and returncode != 0:
        raise AssertionError(f"{command} exited {returncode}\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def torchrun(*args: str, nproc: int = 2, launcher: tuple[str, ...] = (), **kwargs):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *launcher,
        *args,
    ]
    return run(command, **kwargs)


def train_args(out_dir: Path, *overrides: str, module: str = f"{PACKAGE}.train") -> list[str]:
    """`-m <module> --config configs/smoke.yaml` and `overrides`, nothing else: the run the file
    says (two epochs of the task's test-sized data), kept under a test's temporary directory."""
    return ["-m", module, "--config", SMOKE_CONFIG, f"run.out_dir={out_dir}", *overrides]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest complete checkpoint on disk (a file, or a sharded one's directory), or None."""
    saved = RunDir(run_dir).saved_checkpoints()
    return saved[-1] if saved else None


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


HANG_BOUND_SCALE = float(os.environ.get("HANG_BOUND_SCALE", "1"))  # docs/tests.md: every launch's bound times this
# the written bounds fit a model whose training step on a smoke batch takes this long on one CPU
# thread (the language-model starter's: about 22 ms on 2 busy cores); a slower one's are longer
WRITTEN_FOR_STEP_S = 0.05
MOST_SLOWDOWN = 20.0


def step_seconds(seam, cfg, steps: int = 3) -> float:
    """The fastest of `steps` forward and backward passes of `seam`'s model on a smoke batch, on
    this process's threads, here and now (after one pass that warms up)."""
    train_set, _ = seam.build_datasets(cfg)
    collate = getattr(seam, "collate", torch.utils.data.default_collate)
    samples = [train_set[i] for i in range(min(cfg.data.batch_size, len(train_set)))]
    batch = seam.to_device(collate(samples), torch.device("cpu"))
    model = seam.build_model(cfg).train()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        seam.loss_sum(model, batch).backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


@functools.cache
def model_slowdown() -> float:
    """How many times longer than WRITTEN_FOR_STEP_S a training step of the project's model takes
    (1 to MOST_SLOWDOWN), measured once, in this process, on one thread as each launched rank
    runs: a heavy model (a detector on CPUs) gets longer hang bounds, not a failed test. 1 if the
    measurement fails: the error is the launches' own to show."""
    from {{ cookiecutter.package_name }} import task

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.set_num_threads(1)
            seconds = step_seconds(task, load_config(SMOKE_CONFIG))
    except Exception:
        return 1.0
    finally:
        torch.set_num_threads(threads)
    return min(max(1.0, seconds / WRITTEN_FOR_STEP_S), MOST_SLOWDOWN)


def hang_bound(seconds: float) -> tuple[float, str]:
    """A launch's hang bound for one written as `seconds`, and how it was sized."""
    slowdown = model_slowdown()
    bound = seconds * slowdown * HANG_BOUND_SCALE
    how = f"{seconds:.0f} s as written x {slowdown:.1f} (the model's step time over {WRITTEN_FOR_STEP_S} s)"
    how += f" x HANG_BOUND_SCALE={HANG_BOUND_SCALE:g}; HANG_BOUND_SCALE=3 allows 3 times more"
    return bound, how


def finish(processes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process started with start_new_session, all within a
    hang bound sized from `timeout` (hang_bound); then every process of their sessions is killed,
    so none outlives the test. One still running at the deadline fails the test with each
    process's Python stack (SIGABRT makes faulthandler print them: PYTHONFAULTHANDLER is set by
    project_env), the output so far and how the bound was sized."""
    timeout, how = hang_bound(timeout)
    deadline = time.monotonic() + timeout
    try:
        results = []
        for process in processes:
            try:
                stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{hang_report(process, timeout)}\nthe bound: {how}") from None
            results.append((process.returncode, stdout, stderr))
        return results
    finally:
        for process in processes:
            kill_session(process, signal.SIGKILL)


def kill_session(process: subprocess.Popen, sig: int) -> None:
    for pid in [process.pid, *descendants(process.pid)]:  # torchrun runs in a session of its own
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGABRT:
                resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))  # the stacks, not a core file each
            os.kill(pid, sig)


def hang_report(process: subprocess.Popen, timeout: float) -> str:
    kill_session(process, signal.SIGABRT)
    try:
        stdout, stderr = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # a child that still holds the pipes open
        kill_session(process, signal.SIGKILL)
        stdout, stderr = process.communicate()
    command = " ".join(str(part) for part in process.args)
    return f"still running after {timeout:.0f} s: {command}\n{stdout[-20000:]}\n{stderr[-40000:]}"


def wait_for(predicate, timeout: float) -> None:
    """Poll `predicate` every 0.1 s; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


class Writes(io.StringIO):
    """A stream that keeps each write call: a line every rank prints must be one write, or the
    ranks' lines interleave under torchrun's unbuffered `python -u`."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    children = launch.children(pid)
    return children + [p for child in children for p in descendants(child)]
