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
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import BIN, bake

# name -> (answers, the project's pytest options), the longest run first
REPRESENTATIVE = {
    "defaults": ({}, ["--slow"]),
    "image-classification": ({"task": "image_classification"}, ["--task"]),
    "language-model": ({"task": "language_model"}, ["--task"]),
    "fp16-accum4-compile": ({"precision": "fp16", "grad_accum_steps": "4", "compile": True, "slurm": False}, []),
}


def own_tests(project, options) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options]
    return subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def suites(request, tmp_path_factory):
    """The selected projects' own suites, started together and run two at a time, longest first:
    the defaults project's slow tier waits on launches and timeouts half of the time, and a
    third suite would starve its timed drills. xdist keeps this file on one worker (loadfile)."""
    ours = [item for item in request.session.items if item.module is request.module]
    selected = [item.callspec.params["name"] for item in ours if hasattr(item, "callspec")]
    # baked one after the other: cookiecutter changes the working directory while it renders
    projects = {name: bake(tmp_path_factory.mktemp(name), **REPRESENTATIVE[name][0]) for name in selected}
    pool = ThreadPoolExecutor(max_workers=2)
    yield {name: pool.submit(own_tests, project, REPRESENTATIVE[name][1]) for name, project in projects.items()}
    pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_generated_project_passes_its_own_tests(suites, name):
    result = suites[name].result()
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(f"{name} {REPRESENTATIVE[name]}: {summary}")
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
