"""The SLURM batch script against stand-ins for srun and scontrol that behave like Slurm's own
(src/srun/srun_job.c, src/slurmd/slurmstepd/req.c):
- srun answers SIGTERM or SIGHUP by SIGKILLing the step ("forcing job termination") and forwards
  any other signal, SIGUSR1 included, to every process of the step (slurmstepd signals the
  step's whole cgroup: the task, torchrun, the workers, their loader workers);
- srun sets SLURM_CPUS_PER_TASK in the tasks from its own --cpus-per-task only; exits with the
  highest task status, and with --kill-on-bad-exit kills the step when a task fails;
- the time-limit warning (#SBATCH --signal=[B:]SIG@SECONDS) reaches only the batch shell with
  `B:`, otherwise every process of the job's steps but not the batch shell;
- `scontrol requeue` of a job that still runs ends it at once.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PACKAGE, PROJECT, SMOKE_CONFIG, descendants, newest_checkpoint, project_env, run, wait_for

from {{ cookiecutter.package_name }}.tools import launch

SBATCH = PROJECT / "scripts" / "train.sbatch"
# a hang's bound, not a speed check: before srun the script runs three Pythons, one of which imports
# torch to check the settings (2-4 s on quiet cores, 15-30 s at load 10-13)
SCRIPT_HANG_S = 180

SRUN = """#!python
import os, signal, subprocess, sys, time
from pathlib import Path

stub = Path(os.environ["STUB_DIR"])
args = sys.argv[1:]
split = next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))
options, command = args[:split], args[split:]
(stub / "srun.args").write_text("\\n".join(args))
(stub / "srun.pid").write_text(str(os.getpid()))
if "STUB_EXIT" in os.environ:  # a dry run: record the command line only
    sys.exit(int(os.environ["STUB_EXIT"]))
cpus = next((o.split("=", 1)[1] for o in options if o.startswith("--cpus-per-task=")), "1")


def step(pid):  # the step's cgroup: the tasks and everything they started
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        kids = [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []
    return kids + [p for k in kids for p in step(k)]


def signal_step(sig):
    for pid in step(os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def forward(signum, frame):
    if signum in (signal.SIGTERM, signal.SIGHUP):
        print("srun: forcing job termination", file=sys.stderr, flush=True)
        signal_step(signal.SIGKILL)
    else:
        signal_step(signum)


for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
env = {**os.environ, "SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": cpus}
tasks = [
    subprocess.Popen(command, env={**env, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)})
    for n in range(int(os.environ["SLURM_NNODES"]))
]
while any(t.poll() is None for t in tasks):
    if "--kill-on-bad-exit=1" in options and any(t.poll() for t in tasks):
        signal_step(signal.SIGKILL)
    time.sleep(0.1)
sys.exit(max(t.returncode if t.returncode >= 0 else 128 - t.returncode for t in tasks))
"""

SCONTROL = """#!python
import os, signal, sys
from pathlib import Path

stub = Path(os.environ["STUB_DIR"])
with open(stub / "scontrol.args", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    os.write(1, "".join(f"{host}\\n" for host in os.environ["STUB_HOSTS"].split(",")).encode())  # one write, as C
elif sys.argv[1] == "requeue" and (stub / "srun.pid").exists():
    try:  # a job that still runs is ended at once
        os.kill(int((stub / "srun.pid").read_text()), signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def slurm(tmp_path, hosts: str = "gpu-node-1,gpu-node-2", **extra) -> dict:
    """The batch shell's environment, with srun and scontrol replaced by the stand-ins."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text.replace("#!python", f"#!{sys.executable}", 1))
        (stubs / name).chmod(0o755)
    env = project_env(
        STUB_DIR=str(tmp_path),
        STUB_HOSTS=hosts,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-node-[1-2]",
        SLURM_NNODES=str(len(hosts.split(","))),
        SLURM_SUBMIT_DIR=str(PROJECT),
        SLURM_CPUS_ON_NODE="64",
        SLURM_CPUS_PER_TASK="64",
        **extra,
    )
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    return env


def srun_args(tmp_path) -> list[str]:
    return (tmp_path / "srun.args").read_text().splitlines()


def scontrol_calls(tmp_path) -> str:
    path = tmp_path / "scontrol.args"
    return path.read_text() if path.exists() else ""


def test_sbatch_builds_the_launch_command(tmp_path):
    run(["bash", str(SBATCH), "optim.lr=3e-4"], env=slurm(tmp_path, STUB_EXIT="0"), timeout=SCRIPT_HANG_S)
    args = srun_args(tmp_path)
    assert args[0] == "--kill-on-bad-exit=1" and "--ntasks-per-node=1" in args
    assert "--cpus-per-task=64" in args  # srun does not inherit it from sbatch (Slurm >= 22.05)
    assert args[args.index("-m") + 1] == f"{PACKAGE}.tools.launch"  # each node counts its own GPUs
    assert not any(a.startswith("--nproc") for a in args)  # not the planned count
    assert "--nnodes=2" in args and "--rdzv-backend=c10d" in args and "--rdzv-id=4242" in args
    assert "--max-restarts=3" in args
    port = int(next(a for a in args if a.startswith("--rdzv-endpoint=gpu-node-1:")).rsplit(":", 1)[1])
    assert port != launch.DEFAULT_MASTER_PORT and 24242 <= port < 24442  # this job's own port, derived from its id
    assert args[[i for i, a in enumerate(args) if a == "-m"][-1] + 1] == f"{PACKAGE}.train"
    assert args[-3:] == ["run.name=slurm-4242", "checkpoint.resume=auto", "optim.lr=3e-4"]


def test_a_config_mistake_stops_the_batch_script_with_one_line_and_exit_2_before_any_node_starts(tmp_path):
    result = run(
        ["bash", str(SBATCH), "optim.lrr=1"], env=slurm(tmp_path, STUB_EXIT="0"), timeout=SCRIPT_HANG_S, check=False
    )
    typo = "config error: optim.lrr: unknown key; did you mean optim.lr? (from the command line's optim.lrr=1)"
    assert (result.returncode, result.stderr.splitlines()) == (2, [typo])
    assert not (tmp_path / "srun.args").exists()  # srun never ran: one line, not one per node


def test_sbatch_asks_for_cpus_and_warns_only_its_batch_shell():
    directives = [line.split()[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    cpus = next(d for d in directives if d.startswith("--cpus-per-task="))
    assert int(cpus.split("=")[1]) >= 1
    warning = next(d for d in directives if d.startswith("--signal="))
    assert warning.startswith("--signal=B:USR1@")  # srun forwards USR1; TERM would kill the step
    assert int(warning.rsplit("@", 1)[1]) > 60  # time for the next log step and a checkpoint


def test_sbatch_requeues_on_the_preemption_exit_code(tmp_path):
    result = run(["bash", str(SBATCH)], env=slurm(tmp_path, STUB_EXIT="75"), timeout=SCRIPT_HANG_S)
    assert result.returncode == 0
    assert "requeue 4242" in scontrol_calls(tmp_path)


def test_sbatch_passes_a_failure_through_without_requeueing(tmp_path):
    result = run(["bash", str(SBATCH)], env=slurm(tmp_path, STUB_EXIT="1"), timeout=SCRIPT_HANG_S, check=False)
    assert result.returncode == 1
    assert "requeue" not in scontrol_calls(tmp_path)


def time_limit_warning(job: subprocess.Popen, tmp_path) -> None:
    """What Slurm does `--signal` seconds before the time limit, as the script's directive says."""
    lines = SBATCH.read_text().splitlines()
    spec = next(line.split("=", 1)[1] for line in lines if line.startswith("#SBATCH --signal="))
    name = spec.removeprefix("B:").split("@")[0]
    sig = signal.Signals(int(name)) if name.isdigit() else signal.Signals[f"SIG{name.removeprefix('SIG')}"]
    if spec.startswith("B:"):
        os.kill(job.pid, sig)  # the batch shell only
        return
    for pid in descendants(int((tmp_path / "srun.pid").read_text())):  # not the batch shell
        os.kill(pid, sig)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="the srun stand-in finds the step in /proc")
def test_time_limit_warning_checkpoints_on_every_rank_and_requeues(tmp_path):
    out = tmp_path / "runs"
    overrides = [f"run.out_dir={out}", "train.epochs=500", "checkpoint.every_steps=100000"]
    env = slurm(tmp_path, hosts="127.0.0.1", CONFIG=SMOKE_CONFIG, NPROC_PER_NODE="2", CUDA_VISIBLE_DEVICES="")
    command = ["bash", str(SBATCH), *overrides]
    job = subprocess.Popen(command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "slurm-4242" / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=90)
        time_limit_warning(job, tmp_path)
        stdout, stderr = job.communicate(timeout=90)
    finally:
        job.kill()
    assert job.returncode == 0, stderr
    assert "forcing job termination" not in stderr  # the step was not killed
    saved = newest_checkpoint(out / "slurm-4242").name
    step = int(saved.removeprefix("step_").removesuffix(".pt"))
    assert f"preempted at step {step}: checkpoint written" in stdout  # every rank stopped at one step
    assert "requeue 4242" in scontrol_calls(tmp_path)
