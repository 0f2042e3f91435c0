"""examples/huggingface swapped in as the README says: a transformers model built from a config,
called with keyword arguments, through the seam files alone (model.py, task.py, tests/test_task.py)."""

import shutil
import subprocess
import sys
import time

import pytest
from conftest import PACKAGE, PROJECT, project_env

EXAMPLE = PROJECT / "examples" / "huggingface"


def startup_seconds(env: dict) -> float:
    """Seconds a fresh interpreter takes here and now to import what the swapped project's processes
    import (its training code, torch, a transformers model): the unit of this test's hang bounds,
    so that they stretch with the machine's load; the example's own tests get it too."""
    began = time.monotonic()
    imports = f"import {PACKAGE}.train, transformers.models.llama.modeling_llama"
    subprocess.run([sys.executable, "-c", imports], env=env, check=True, capture_output=True)
    return time.monotonic() - began


def swapped(tmp_path):
    """A copy of this project with the example's seam files and tests in place, its config synced;
    the copy's path and the environment that imports its package, with the start-up measured in it."""
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns("runs", ".venv", "__pycache__", "*.egg-info"))
    for name in ("model.py", "task.py"):
        shutil.copy(EXAMPLE / name, project / "src" / PACKAGE / name)
    shutil.copy(EXAMPLE / "tests" / "test_task.py", project / "tests" / "test_task.py")
    env = project_env(PYTHONPATH=f"{project / 'src'}:{project / 'tests'}", CUDA_VISIBLE_DEVICES="")
    env["STARTUP_SECONDS"] = str(startup_seconds(env))
    launch(project, env, sys.executable, "-m", f"{PACKAGE}.config", "sync", "configs/default.yaml", startups=5)
    return project, env


def launch(project, env, *command, startups: float) -> subprocess.CompletedProcess:
    """`command` run in `project`, which must succeed within `startups` start-ups' time
    (STARTUP_SECONDS), a bound only a hang passes: 10 x or more what it took on a 2-core box under
    a load of 8 (a start-up 11-14 s; config sync took 0.5 start-ups, the example's tests 10-13, the
    proofs 3)."""
    timeout = startups * float(env["STARTUP_SECONDS"])
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.mark.task
def test_the_hugging_face_example_passes_its_own_tests_and_the_fsdp_proofs(tmp_path):
    """Its tests/test_task.py with --task: the seam, tied embeddings and units, diagnose unused,
    and the round trip (a tokenizer.json, the smoke check's run under fsdp, export,
    from_pretrained, the same loss, a sample from the sharded checkpoint)."""
    pytest.importorskip("transformers", reason="the huggingface extra: pip install -e '.[huggingface]'")
    project, env = swapped(tmp_path)
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--task", "tests/test_task.py"]
    result = launch(project, env, *pytest_run, startups=200)
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]

    proofs = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proved = launch(project, env, *proofs, "tests/dist_proofs.py", str(tmp_path), "--only", "fsdp", startups=40)
    assert "fsdp proofs on 2 ranks: PASS (0 failed" in proved.stdout, proved.stdout[-3000:]
