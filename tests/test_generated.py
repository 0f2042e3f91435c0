"""Representative baked projects pass their own test suites.

The defaults project runs every tier (`pytest --slow`: the maths proofs, fault drills,
launchers, the swaps, the seam's contract on five stand-in models), split in five runs (the
drills, the exit-status stress drill, the W&B and MLflow drills with the packed-shards drills,
the task shapes: the stand-ins and the swaps, the rest) that go side by side; the rest and the
shapes with `--fsdp`, so that its MLP with BatchNorm goes through the FSDP proofs, drills and
smoke check a ddp project skips, but for the 3-rank proofs, which the language model runs. One
project with the other answers (fp16, accumulation, compile, no SLURM, Kubernetes) runs the fast
tier, which holds what those answers change (the settings' defaults, the launchers, the
manifests checked offline; the tests' own run stays fp32, uncompiled, ddp and one micro-batch a
step on a CPU, and the tests of those name them), and its Kubernetes drills (pods on loopback
under each operator's environment, SIGTERM to PID 1 within the grace period); the bake matrix in
test_bake.py lints every other combination. The starters run the fast tier plus their own slow
tests (`pytest --task`), less the generic drills, loop wiring and stand-in seam tests the
defaults project already runs: the language model's real-text training and sampling, the image
classifier's ResNet-18 learning the drawn shapes from JPEG files to 0.9 top-1 (its FSDP runs are
the defaults' MLP with BatchNorm and the language model's, a project that shards). The language
model is baked with strategy=fsdp, the way a project that shards runs its suite: the FSDP proofs
on its tied embedding on 2 ranks and 3, and smoke.sh under fsdp.
"""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import bake

DRILLS = ["tests/test_faults.py", "tests/test_launchers.py", "tests/test_multinode.py", "tests/test_sbatch.py"]
EXITS = "tests/test_exits.py"  # the exit-status stress drill: launches back to back and side by side
TRACKERS = "tests/test_trackers.py"  # W&B and MLflow on 2 ranks, offline stores
SHARDS = "tests/test_packs.py"  # packed shards: a folder and an S3-compatible server on loopback
SEAM = "--ignore=tests/test_seam.py"  # the stand-in tasks replace the seam: the same tests in every project
CALLBACKS = "--ignore=tests/test_callbacks.py"  # the loop's callbacks on the plain stand-in: the same in every project
# every task shape through the seam: the stand-ins (test_seam.py) and the worked swaps (test_swaps.py)
SHAPES = ["tests/test_seam.py", "tests/test_swaps.py"]
# the language model's (fsdp), a project that shards: its 3-rank proofs, and smoke.sh under fsdp
FSDP_ELSEWHERE = "fsdp_proofs_hold_on_three_ranks"
# the task's slow tests that are not the task's own: evaluation counts and resume, which the
# defaults project runs for every code path they share; of the FSDP runs, the language model
# (fsdp) passes smoke.sh (its project's strategy) and reaches its ddp run's evaluation
SHARED = "eval_counts_each_sample or resume_mid_epoch"
# and of the fast tier, the loop's wiring of each schedule, named optimizer and their resume, the
# NaN stop and the setting aside of an abandoned attempt's checkpoints (test_wiring.py), the resumes
# with accumulation and on another world size (test_resume.py), a failed background write, a
# checkpoint of the previous config layout and a bad override refused on every rank:
# train.py's calls, the same whatever the model; the task's own optimizer, schedule and randomness on
# resume stay
LOOP_WIRING = (
    "uses_the_lr_of_its_schedule or steps_the_named_optimizer or resumed_mid_schedule"
    " or nan_loss_stops_the_run or sets_the_later_ones_aside"
    " or with_accumulation_killed_mid_epoch or rest_of_its_epoch_once or runs_20_samples_a_step"
    " or moves_the_peak_lr or never_listed_as_a_change or background_write_that_fails_stops_the_run"
    " or previous_layout_resumes or bad_override_before_any_collective"
)
IMAGE_TESTS = [
    "--task",
    SEAM,
    CALLBACKS,
    "-k",
    f"not ({SHARED} or smoke_sh_passes or {LOOP_WIRING})",
]
# the fast tier, the task's own tests and the slow FSDP proofs (`-m` picks them among --slow's)
LANGUAGE_MODEL_TESTS = [
    "--slow",
    "-m",
    "not slow or task or fsdp",
    SEAM,
    CALLBACKS,
    "-k",
    f"not ({SHARED} or {LOOP_WIRING} or smoke_check_passes_under_fsdp or killed_mid_epoch or ddp_checkpoint_loads)",
]

OTHER_ANSWERS = {"precision": "fp16", "grad_accum_steps": "4", "compile": True, "slurm": False, "kubernetes": True}
# name -> (answers, the project's pytest options), the longest run first
REPRESENTATIVE = {
    "defaults-rest": (
        {},
        [
            "--slow",
            "--fsdp",
            "-k",
            f"not ({FSDP_ELSEWHERE})",
            *(f"--ignore={path}" for path in [*DRILLS, EXITS, TRACKERS, SHARDS, *SHAPES]),
        ],
    ),
    "defaults-shapes": ({}, ["--slow", "--fsdp", *SHAPES]),
    "defaults-trackers-shards": ({}, ["--slow", TRACKERS, SHARDS]),
    "image-classification": ({"task": "image_classification"}, IMAGE_TESTS),
    "defaults-drills": ({}, ["--slow", *DRILLS]),
    "language-model-fsdp": ({"task": "language_model", "strategy": "fsdp"}, LANGUAGE_MODEL_TESTS),
    "defaults-exits": ({}, ["--slow", EXITS]),
    "fp16-accum4-compile-k8s": (OTHER_ANSWERS, [SEAM]),
    "k8s-drills": (OTHER_ANSWERS, ["--slow", "tests/test_kubernetes.py"]),
}


def suites_at_once(count: int) -> int:
    """Two on 2 cores, as measured best (a suite keeps a core busy and its 2-rank launches a
    second); one more per 2 cores beyond that."""
    return min(count, max(2, len(os.sched_getaffinity(0)) // 2 + 1))


def own_tests(project, options) -> tuple[subprocess.CompletedProcess, float]:
    """The project's pytest run, and its wall time in seconds."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options]
    # one thread for the suite's own process, as its launches have (conftest.project_env): two
    # suites share 2 cores, and torch's second thread spins for work there (a third of the CPU
    # time of the in-process training runs, for the same wall time)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    # a hang's bound, not a speed check: on a host at half its usual speed (2026-12-05) the
    # defaults' slow tier took 1181 s against 679 s the day before
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=2400)
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def suites(request, tmp_path_factory):
    """The selected projects' suites, longest first, two at a time on 2 cores: the CPU-bound
    suites keep both cores busy without starving the timed drills. `--dist loadfile` keeps this
    module on one xdist worker, and the other worker takes the rest of the template's tests."""
    ours = [item for item in request.session.items if item.module is request.module]
    selected = [item.callspec.params["name"] for item in ours]
    # baked one after the other: cookiecutter changes the working directory while it renders
    projects = {name: bake(tmp_path_factory.mktemp(name), **REPRESENTATIVE[name][0]) for name in selected}
    pool = ThreadPoolExecutor(max_workers=suites_at_once(len(projects)))
    yield {name: pool.submit(own_tests, project, REPRESENTATIVE[name][1]) for name, project in projects.items()}
    pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_generated_project_passes_its_own_tests(suites, name, pytestconfig):
    result, seconds = suites[name].result()
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    line = f"{name} {REPRESENTATIVE[name]}: {summary} (wall {seconds:.0f} s with the other suites)"
    print(line)
    times = pytestconfig.rootpath / "build" / "suite-times.txt"  # .ci/run prints it: where CI's minutes go
    times.parent.mkdir(exist_ok=True)
    with times.open("a") as out:
        out.write(line + "\n")
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert " passed" in summary and " failed" not in summary
