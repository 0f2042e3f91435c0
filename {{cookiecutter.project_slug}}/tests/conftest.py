"""Shared helpers: run the project's entry points the way users do, bounded in time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = "{{ cookiecutter.package_name }}"
SMOKE_CONFIG = str(PROJECT / "configs" / "smoke.yaml")


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
    env.update(extra)
    return env


def run(command: list[str], timeout: float = 120, env: dict | None = None, check: bool = True):
    """Run a command from the project root; a hang fails the test instead of the CI job."""
    result = subprocess.run(
        command, cwd=PROJECT, env=env or project_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


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
    """`-m <module> --config smoke.yaml` with the run kept under a test's temporary directory."""
    return ["-m", module, "--config", SMOKE_CONFIG, f"run.out_dir={out_dir}", *overrides]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
