"""Exit statuses under stress: many 2-rank launches one after another and side by side.

A finished run must exit 0 every time, and a failed one must fail with the workers' own exit
codes, never with a rank that aborts (SIGABRT) while Python shuts down. Side by side the
launches are independent jobs on one machine, as on a box several people share: each picks its
own rendezvous port (--standalone) and writes under its own run directory.

The counts are sized for a CI run (about 2 minutes on 2 CPUs, next to the other suites, whose
hundreds of launches each check their own exit too); before a release, or after a change to how
processes end, run more: EXIT_STRESS_SEQUENTIAL=40 EXIT_STRESS_ROUNDS=6
python -m pytest --slow tests/test_exits.py.
"""

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import PROJECT, SMOKE_CONFIG, project_env

SEQUENTIAL = int(os.environ.get("EXIT_STRESS_SEQUENTIAL", "4"))  # one after another, train.sh and smoke.sh in turn
ROUNDS = int(os.environ.get("EXIT_STRESS_ROUNDS", "1"))  # rounds of launches started together
SIDE_BY_SIDE = 4  # launches in a round
ABORTS = ("SIGABRT", "terminate called", "Signal 6")


def launch(kind: str, out_dir: Path) -> subprocess.CompletedProcess:
    if kind == "train":
        script, args = "train.sh", ["--config", SMOKE_CONFIG, "train.max_steps=20"]
    elif kind == "smoke":
        script, args = "smoke.sh", []
    else:  # a run that fails after the group is up: a checkpoint to resume that does not exist
        script, args = "train.sh", ["--config", SMOKE_CONFIG, f"checkpoint.resume={out_dir}/missing.pt"]
    command = ["bash", str(PROJECT / "scripts" / script), *args, f"run.out_dir={out_dir}"]
    env = project_env(CUDA_VISIBLE_DEVICES="")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def problem(kind: str, result: subprocess.CompletedProcess) -> str | None:
    """What is wrong with a launch's exit, or None."""
    output = result.stdout + result.stderr
    if any(sign in output for sign in ABORTS):
        return f"{kind}: a rank aborted (exit {result.returncode})\n{result.stderr[-3000:]}"
    expected = {"train": (0, "done: 20 steps"), "smoke": (0, "smoke: PASS"), "error": (1, "missing.pt does not exist")}
    code, line = expected[kind]
    if result.returncode != code or line not in output:
        return f"{kind}: exit {result.returncode}, expected {code} and {line!r}\n{output[-3000:]}"
    return None


@pytest.mark.slow
def test_launches_one_after_another_all_exit_as_they_should(tmp_path):
    kinds = ["train", "smoke"] * (SEQUENTIAL // 2) + ["error"] * max(1, SEQUENTIAL // 4)
    problems = [problem(kind, launch(kind, tmp_path / f"{i}")) for i, kind in enumerate(kinds)]
    failed = [p for p in problems if p]
    assert not failed, f"{len(failed)} of {len(kinds)} launches exited wrongly:\n" + "\n".join(failed)


@pytest.mark.slow
def test_launches_side_by_side_on_one_machine_all_exit_0(tmp_path):
    kinds = ["train", "smoke"] * (SIDE_BY_SIDE // 2)
    failed = []
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        for round_ in range(ROUNDS):
            dirs = [tmp_path / f"{round_}-{i}" for i in range(SIDE_BY_SIDE)]
            results = list(pool.map(launch, kinds, dirs))
            failed += [p for p in map(problem, kinds, results) if p]
    assert not failed, f"{len(failed)} of {ROUNDS * SIDE_BY_SIDE} launches exited wrongly:\n" + "\n".join(failed)
