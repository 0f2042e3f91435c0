"""Representative baked projects pass their own test suite; pre-commit passes in a fresh project.

The defaults project runs every tier (`pytest --slow`: fault drills, launchers, the swaps);
one project with the other answers (fp16, accumulation, compile, no SLURM) runs the fast tier,
which holds what those answers change (the maths proofs and the unit tests); the bake matrix in
test_bake.py lints every other combination. The starters run the fast tier plus the slow tests
of their task end to end (`pytest --task`): the language model's real-text training and
sampling, the image classifier's ResNet-18 learning the drawn shapes from JPEG files to 0.9
top-1, and for both the evaluation counts on 1, 2 and 3 ranks, a bit-identical resume and the
smoke check.
"""

import os
import subprocess
import sys

import pytest
from conftest import BIN, bake

# answers -> the project's pytest options; the longest run first, so that it starts early and the
# other xdist worker takes the rest
REPRESENTATIVE = {
    "defaults": ({}, ["--slow"]),
    "image-classification": ({"task": "image_classification"}, ["--task"]),
    "language-model": ({"task": "language_model"}, ["--task"]),
    "fp16-accum4-compile": ({"precision": "fp16", "grad_accum_steps": "4", "compile": True, "slurm": False}, []),
}


@pytest.mark.slow
@pytest.mark.parametrize(("answers", "options"), REPRESENTATIVE.values(), ids=REPRESENTATIVE.keys())
def test_generated_project_passes_its_own_tests(tmp_path, answers, options):
    project = bake(tmp_path, **answers)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"{project.name} {answers} {options}: {summary}")
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
