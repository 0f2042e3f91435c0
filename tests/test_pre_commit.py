"""pre-commit passes in a fresh project, with the hooks it ships (local hooks from PyPI)."""

import os
import subprocess

import pytest
from conftest import BIN, bake


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
