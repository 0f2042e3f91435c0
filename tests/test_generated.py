"""Representative baked projects pass their own test suite; pre-commit passes in a fresh project.

The defaults project runs every tier (`pytest --slow`: fault drills, launchers, the swaps);
one project with the other answers (fp16, accumulation, compile, no SLURM) runs the fast tier,
which holds what those answers change (the maths proofs and the unit tests); the bake matrix in
test_bake.py lints every other combination. The language-model starter also runs the slow
tests its task changes: its real-text training and sampling, the proofs on its own data, a
bit-identical resume and the smoke check; so does the image starter (a ResNet-18 learning the
drawn shapes from JPEG files to 0.9 top-1).
"""

import os
import subprocess
import sys

import pytest
from conftest import BIN, bake

# the slow tests a starter's task changes: its real run, the proofs on its data, resume, smoke
STARTER_SLOW = [
    "--slow",
    "tests/test_task.py",
    "tests/test_distributed.py",
    "tests/test_faults.py::test_resume_mid_epoch_is_bit_identical_to_an_uninterrupted_run",
    "tests/test_launchers.py::test_smoke_sh_passes_on_cpu_and_skips_gpu_checks_with_reasons",
]
# answers -> the pytest runs, one argument list each
REPRESENTATIVE = {
    "defaults": ({}, [["--slow"]]),
    "fp16-accum4-compile": ({"precision": "fp16", "grad_accum_steps": "4", "compile": True, "slurm": False}, [[]]),
    "language-model": ({"task": "language_model"}, [[], STARTER_SLOW]),
    "image-classification": ({"task": "image_classification"}, [[], STARTER_SLOW]),
}


@pytest.mark.slow
@pytest.mark.parametrize(("answers", "runs"), REPRESENTATIVE.values(), ids=REPRESENTATIVE.keys())
def test_generated_project_passes_its_own_tests(tmp_path, answers, runs):
    project = bake(tmp_path, **answers)
    for arguments in runs:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *arguments],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        print(f"{project.name} {answers} {arguments}: {summary}")
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
