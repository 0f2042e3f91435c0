"""Representative baked projects pass their own test suite; pre-commit passes in a fresh project.

The defaults project runs every tier (`pytest --slow`: fault drills, launchers, the swaps);
the others run the fast tier, which holds what their answers change (precision, accumulation,
compile: the maths proofs and the unit tests).
"""

import os
import subprocess
import sys

import pytest
from conftest import BIN, bake

REPRESENTATIVE = {
    "defaults": ({}, ["--slow"]),
    "fp16-accum4": ({"precision": "fp16", "grad_accum_steps": "4", "sync_batchnorm": False}, []),
    "bf16-compile": ({"precision": "bf16", "compile": True, "slurm": False, "license": "none"}, []),
}


@pytest.mark.slow
@pytest.mark.parametrize(("answers", "tier"), REPRESENTATIVE.values(), ids=REPRESENTATIVE.keys())
def test_generated_project_passes_its_own_tests(tmp_path, answers, tier):
    project = bake(tmp_path, **answers)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tier],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"{project.name} {answers}: {summary}")
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert " passed" in summary and " failed" not in summary


@pytest.mark.slow
def test_pre_commit_passes_in_a_fresh_project(tmp_path):
    project = bake(tmp_path / "out")
    env = dict(
        os.environ, PRE_COMMIT_HOME=str(tmp_path / "pre-commit-home"), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}"
    )
    for command in (["git", "init", "-q"], ["git", "add", "-A"]):
        subprocess.run(command, cwd=project, check=True, env=env)
    result = subprocess.run(
        [str(BIN / "pre-commit"), "run", "--all-files"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
