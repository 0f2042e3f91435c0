"""The node launcher: processes per node, threads under SLURM, stopping, exit status, ports."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import conftest
import pytest
from conftest import PACKAGE, PROJECT, SMOKE_CONFIG, finish, project_env

from {{ cookiecutter.package_name }}.base import cpus, preemption
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.loop import parallel
from {{ cookiecutter.package_name }}.tools import launch
from {{ cookiecutter.package_name }}.tools.launch import LaunchError


@pytest.mark.parametrize(
    ("requested", "gpus", "planned", "expected"),
    [(None, 8, 8, 8), (None, 4, 8, 4), (None, 0, 8, 2), ("4", 8, 8, 4), ("3", 0, 8, 3)],
)
def test_one_process_per_visible_gpu_unless_told(requested, gpus, planned, expected):
    assert launch.processes_per_node(requested, gpus, planned)[0] == expected


def test_an_allocation_smaller_than_planned_is_used_and_said():
    # sbatch --gpus-per-node=4 on a project planned for 8: 4 ranks, not 8 sharing 4 GPUs
    count, note = launch.processes_per_node(None, 4, 8)
    assert count == 4 and "planned for 8" in note


@pytest.mark.parametrize("requested", ["8", "5"])
def test_more_processes_than_gpus_is_refused(requested):
    with pytest.raises(LaunchError, match="NPROC_PER_NODE<=4"):
        launch.processes_per_node(requested, 4, 8)


@pytest.mark.parametrize("requested", ["0", "two", "-1"])
def test_a_process_count_must_be_positive(requested):
    with pytest.raises(LaunchError, match="positive"):
        launch.processes_per_node(requested, 4, 8)


@pytest.mark.parametrize(
    ("env", "variable", "count"),
    [
        ({}, "NPROC_PER_NODE", None),
        ({"PET_NPROC_PER_NODE": "4"}, "PET_NPROC_PER_NODE", "4"),  # a TrainJob on CPU nodes: its CPU count
        ({"PET_NPROC_PER_NODE": "auto"}, "NPROC_PER_NODE", None),  # a TrainJob with GPUs: one per visible GPU
        ({"NPROC_PER_NODE": "2", "PET_NPROC_PER_NODE": "8"}, "NPROC_PER_NODE", "2"),  # the user's own setting wins
    ],
)
def test_a_process_count_comes_from_the_user_or_the_operator(env, variable, count):
    assert launch.requested_processes(env) == (variable, count)


def test_a_slow_models_launches_get_hang_bounds_sized_from_its_step_time(monkeypatch):
    # a detector on CPUs steps 10 times slower than the bounds were written for: 10 times longer
    monkeypatch.setattr(conftest, "step_seconds", lambda seam, cfg: conftest.WRITTEN_FOR_STEP_S * 10)
    conftest.model_slowdown.cache_clear()
    try:
        bound, how = conftest.hang_bound(180)
        assert bound == pytest.approx(1800) and "x 10.0 (the model's step time" in how and "HANG_BOUND_SCALE" in how
        monkeypatch.setattr(conftest, "step_seconds", lambda seam, cfg: conftest.WRITTEN_FOR_STEP_S * 1000)
        conftest.model_slowdown.cache_clear()
        assert conftest.hang_bound(180)[0] == pytest.approx(180 * conftest.MOST_SLOWDOWN)  # a hang still ends
    finally:
        conftest.model_slowdown.cache_clear()


def test_the_launchers_own_refusal_exits_2_with_one_line_before_any_process_starts(tmp_path):
    # a refusal is a usage error, as torchrun's and argparse's are (2), not a failed run (1)
    command = [sys.executable, "-m", f"{PACKAGE}.tools.launch", "--standalone", "-m", f"{PACKAGE}.train"]
    command += ["--config", SMOKE_CONFIG, f"run.out_dir={tmp_path}"]
    result = subprocess.run(command, env=project_env(NPROC_PER_NODE="two"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "launch error: NPROC_PER_NODE='two': use a positive number of processes"
    assert not (tmp_path / "smoke").exists()  # nothing ran


def test_a_bad_operator_count_names_its_variable():
    with pytest.raises(LaunchError, match="PET_NPROC_PER_NODE=8 but this node shows 4 GPU"):
        launch.prepare(["-m", "pkg.train"], {"PET_NPROC_PER_NODE": "8"}, gpus=4, affinity=16)


@pytest.mark.parametrize(
    ("env", "args", "expected"),
    [
        ({"JOB_COMPLETION_INDEX": "1"}, [], ["--node-rank=1"]),  # a JobSet's pod 1
        ({"JOB_COMPLETION_INDEX": "1", "PET_NODE_RANK": "1"}, [], []),  # a TrainJob: torchrun reads PET_NODE_RANK
        ({"JOB_COMPLETION_INDEX": "1"}, ["--node-rank=0"], ["--node-rank=0"]),
        ({}, [], []),
    ],
)
def test_an_indexed_jobs_pod_index_is_its_node_rank(env, args, expected):
    assert launch.node_rank_from_job_index(args, env) == expected


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "200000 100000\n"}, 2),  # cgroup v2: limits.cpu: 2
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: 2 threads' worth, rounded up
        ({"cpu.max": "max 100000\n"}, None),  # no limit
        ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_a_pods_cpu_limit_caps_the_cpus_it_sees(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpus.cpu_limit(tmp_path) == limit
    assert cpus.usable_cpus(tmp_path) == min(cpus.usable_cpus(tmp_path / "none"), limit or 10**6)


@pytest.mark.parametrize(
    ("env", "affinity", "owned"),
    [
        ({}, 16, 16),  # no SLURM: the affinity mask
        ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "32", "SLURM_CPUS_ON_NODE": "64"}, 128, 32),  # unbound task
        ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "32"}, 32, 32),  # a bound task: both agree
        ({"SLURM_STEP_ID": "0", "SLURM_CPUS_ON_NODE": "4"}, 128, 4),  # no --cpus-per-task
        ({"SLURM_CPUS_PER_TASK": "32", "SLURM_CPUS_ON_NODE": "64"}, 64, 64),  # the batch shell owns the node's share
        ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "64"}, 8, 8),  # never more than the mask
        ({"SLURM_CPUS_ON_NODE": ""}, 8, 8),
    ],
)
def test_cpus_owned_under_slurm(env, affinity, owned):
    assert cpus.job_cpus(env, affinity) == owned


@pytest.mark.parametrize(("owned", "processes", "threads"), [(64, 8, 8), (1, 8, 1), (7, 8, 1), (10, 4, 2)])
def test_threads_are_shared_out_and_never_0(owned, processes, threads):
    # SLURM_CPUS_ON_NODE / GPUS_PER_NODE would give 0 threads with fewer CPUs than GPUs
    assert cpus.threads_per_process(owned, processes) == threads


def test_prepare_sizes_threads_from_slurms_allocation():
    env = {"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "16", "SLURM_CPUS_ON_NODE": "16", "PLANNED_GPUS_PER_NODE": "8"}
    command, child_env = launch.prepare(["--standalone", "-m", "pkg.train"], env, gpus=4, affinity=96)
    assert command[-4:] == ["--nproc-per-node=4", "--standalone", "-m", "pkg.train"]
    assert child_env["OMP_NUM_THREADS"] == "4"


def test_prepare_keeps_the_users_thread_count():
    _, child_env = launch.prepare(["-m", "x"], {"OMP_NUM_THREADS": "3"}, gpus=0, affinity=16)
    assert child_env["OMP_NUM_THREADS"] == "3"


TERM, INT = signal.SIGTERM, signal.SIGINT


@pytest.mark.parametrize(
    ("status", "stop", "preempted", "expected"),
    [
        (0, None, False, 0),
        (1, None, False, 1),
        (0, TERM, True, 75),  # the workers checkpointed on the launcher's request
        (0, None, True, 75),  # ... or on SLURM's USR1, sent to them directly
        (0, INT, True, 130),  # Ctrl-C: checkpointed, but a stop of the user's, nothing to requeue
        (1, TERM, False, 1),  # stopped before any checkpoint (a second signal): torchrun's failure
        (0, TERM, False, 0),  # the run finished before the stop took effect
    ],
)
def test_only_a_checkpointed_preemption_exits_75(status, stop, preempted, expected):
    assert preemption.exit_status(status, stop, preempted) == expected


def test_a_worker_killed_by_a_signal_is_reported_like_a_shell_does():
    assert preemption.exit_status(-9, None, False) == 137


def test_a_static_rendezvous_gets_the_default_port_unless_one_is_given():
    command, _ = launch.prepare(["--master-addr=10.0.0.1", "-m", "x"], {}, gpus=0, affinity=4)
    assert f"--master-port={launch.DEFAULT_MASTER_PORT}" in command
    command, _ = launch.prepare(["--master-addr=10.0.0.1", "--master-port=4000", "-m", "x"], {}, gpus=0, affinity=4)
    assert not any(arg.startswith("--master-port=") and arg != "--master-port=4000" for arg in command)
    command, _ = launch.prepare(["--master_addr=10.0.0.1", "--master_port=4000", "-m", "x"], {}, gpus=0, affinity=4)
    assert f"--master-port={launch.DEFAULT_MASTER_PORT}" not in command  # torchrun's underscore spelling too
    command, _ = launch.prepare(["--standalone", "-m", "x"], {}, gpus=0, affinity=4)
    assert not any(arg.startswith("--master-port") for arg in command)


def test_free_port_is_derived_from_the_job_and_skips_a_busy_one():
    port = launch.free_port(4242)
    assert 24242 <= port < 24442
    with socket.socket() as busy:
        busy.bind(("", port))
        assert launch.free_port(4242) != port


def test_a_process_handles_a_signal_only_once_it_installed_a_handler():
    code = "import signal, time; signal.signal(signal.SIGUSR1, print); print(1, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        assert preemption.handles(child.pid, signal.SIGUSR1)
        assert not preemption.handles(child.pid, signal.SIGUSR2)
    finally:
        child.kill()
        child.wait()


# Stands in for torch: says it is being imported, then never finishes, so the launcher stays in
# the slow part of its start for as long as the test needs.
STUCK_TORCH = """
import os, pathlib, time
pathlib.Path(os.environ["TORCH_IMPORT_STARTED"]).touch()
time.sleep(600)
"""
HANG_S = 120  # a hang's bound, not a speed check: the launcher reached torch's import in 0.1-0.6 s (2 busy cores)


def test_a_stop_while_the_launcher_starts_exits_as_preempted_before_torchrun_runs_and_says_so(tmp_path):
    # the slow part of a start is importing torch (the settings' check, counting GPUs); PID 1 of a
    # container ignores signals it has no handler for, so the handler is there before that import.
    # The import is held for as long as the test needs: the stop lands in it, whatever the load.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(STUCK_TORCH)
    started = tmp_path / "torch-import-started"
    env = project_env(CUDA_VISIBLE_DEVICES="", TORCH_IMPORT_STARTED=str(started))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])  # before the real torch
    launcher = subprocess.Popen(  # the script execs the launcher: the same process
        ["bash", "scripts/train.sh", "--config", "configs/smoke.yaml"],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + HANG_S
    while not started.exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    handled = started.exists() and preemption.handles(launcher.pid, signal.SIGTERM)
    launcher.send_signal(signal.SIGTERM)
    # a launcher still running now fails the test with its Python stack and what it printed
    [(code, _, said)] = finish([launcher], HANG_S)
    assert started.exists(), f"exit {code} before importing torch: {said}"
    assert handled  # installed before torch's import began
    assert code == preemption.PREEMPTED_EXIT_CODE, said
    assert said.splitlines() == [
        "launch: SIGTERM before training started: nothing ran, nothing to save; exit 75 (requeue or rerun to start)"
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--standalone", "-m", f"{PACKAGE}.train", "--config", "a.yaml", "x.y=1", "--config=b.yaml"],
            (["a.yaml", "b.yaml"], ["x.y=1"]),
        ),
        (["-m", f"{PACKAGE}.tools.smoke", "optim.lr=-1"], ([], ["optim.lr=-1"])),
        (["-m", f"{PACKAGE}.train", "--help"], None),  # another option: the module's own parser answers
        (["-m", f"{PACKAGE}.train", "--config"], None),
        (["-m", f"{PACKAGE}.tools.diagnose", "doctor"], None),  # a module of other arguments
        (["--standalone", "script.py", "x.y=1"], None),
    ],
)
def test_the_launcher_checks_the_settings_of_the_modules_that_read_them_only(args, expected):
    assert launch.settings_arguments(args) == expected


def test_the_launcher_checks_the_settings_the_workers_read_and_leaves_the_rest_to_them():
    with pytest.raises(ConfigError, match="optim.lrr: unknown key"):
        launch.check_settings(["--standalone", "-m", f"{PACKAGE}.train", "--config", SMOKE_CONFIG, "optim.lrr=1"])
    for module in (f"{PACKAGE}.train", f"{PACKAGE}.tools.smoke"):  # the settings checked as the workers check them
        with pytest.raises(ConfigError, match="fsdp needs torch" if parallel.floor_problem() else "fp16 under .*fsdp"):
            launch.check_settings(["-m", module, "parallel.strategy=fsdp", "train.precision=fp16"])
    launch.check_settings(["--standalone", "-m", f"{PACKAGE}.train", "--config", SMOKE_CONFIG, "--help"])


def test_finished_children_are_collected_except_the_one_kept():
    # what the launcher does as PID 1 of a container, where the pod's orphans become its children
    kept, orphan = (subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2))
    time.sleep(0.5)  # both have exited: zombies until collected
    launch.reap_orphans(keep=kept.pid)
    assert not Path(f"/proc/{orphan.pid}").exists()  # collected
    assert Path(f"/proc/{kept.pid}").exists() and kept.wait(timeout=5) == 0  # its status left for its Popen


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
def test_children_are_found_whichever_thread_started_them_and_once_they_finished():
    # torchrun starts its workers from threads that may end: their children must still be found
    started = []
    thread = threading.Thread(target=lambda: started.append(subprocess.Popen(["sleep", "30"])))
    thread.start()
    thread.join()
    # a process name may hold ") ", which /proc/<pid>/stat does not escape
    finished = subprocess.Popen([sys.executable, "-c", "open('/proc/self/comm', 'w').write('a) b')"])
    time.sleep(0.5)  # `finished` is a zombie now: not reaped until its wait below
    try:
        assert set(launch.children(os.getpid())) >= {started[0].pid, finished.pid}
        assert launch.children(started[0].pid) == []
    finally:
        started[0].kill()
        started[0].wait()
        finished.wait()


FAKE_TORCHRUN = """
import os, signal, subprocess, sys, time
# a worker like ours: ignores the stop signal while starting, handles it once PreemptionFlag exists
worker = '''
import os, pathlib, signal, time
time.sleep(0.5)
stop = []
signal.signal(signal.SIGUSR1, lambda *a: stop.append(1))
while not stop:
    time.sleep(0.05)
pathlib.Path(os.environ["PREEMPTION_MARKER"]).touch()
'''
sys.exit(subprocess.call([sys.executable, "-c", worker]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_a_stop_reaches_the_workers_and_ends_with_75_or_130_for_ctrl_c(stop):
    script = (
        "import signal, sys\n"
        "from {{ cookiecutter.package_name }}.tools import launch\n"
        f"sys.exit(launch.Supervisor([sys.executable, '-c', {FAKE_TORCHRUN!r}], dict()).run())\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT, env=project_env())
    try:
        time.sleep(1.5)  # the worker is running
        supervisor.send_signal(stop)
        expected = preemption.INTERRUPTED_EXIT_CODE if stop == signal.SIGINT else preemption.PREEMPTED_EXIT_CODE
        assert supervisor.wait(timeout=20) == expected
    finally:
        supervisor.kill()
