"""The node launcher behind scripts/*.sh and scripts/train.sbatch: run it once per node.

    python -m {{ cookiecutter.package_name }}.tools.launch [torchrun options] -m MODULE [arguments]
    python -m {{ cookiecutter.package_name }}.tools.launch free-port SEED    # a free port for this node's rendezvous
    python -m {{ cookiecutter.package_name }}.tools.launch preempted-exit-code   # 75, for scripts that requeue on it
    python -m {{ cookiecutter.package_name }}.tools.launch check -m MODULE [arguments]   # the settings only

It checks the settings, plans the node, then runs torchrun and stays with it:
- settings: for the training and the smoke check (`-m` this package's train or tools.smoke), the
  --config files and overrides are composed and checked once here (train.check_settings, on this
  node's kind of device), as every worker will: a mistake in them is one line and exit 2 before
  any worker starts, instead of one line per rank and torchrun's report of the failed workers;
- processes: NPROC_PER_NODE (or a TrainJob's PET_NPROC_PER_NODE), by default one per GPU that
  CUDA shows this process (which honours CUDA_VISIBLE_DEVICES, MIG and cgroups, unlike
  `nvidia-smi -L`), 2 on a CPU-only machine; never more processes than GPUs;
- threads: OMP_NUM_THREADS = the CPUs this job owns here (affinity mask, a pod's CPU limit,
  SLURM's allocation) shared out among the processes, at least 1;
- node rank: a Kubernetes Indexed Job's JOB_COMPLETION_INDEX (a JobSet's pods) unless
  --node-rank or PET_NODE_RANK gives it; torchrun reads the other PET_* variables itself;
- stopping: the first TERM, INT, HUP or USR1 becomes SIGUSR1 for the workers, which agree on it
  at their next log step (on every node), write a checkpoint and exit; a second one makes
  torchrun stop them at once. torchrun ignores SIGUSR1 (SLURM hands it to every process of the
  step): left to torchrun, a stop kills the workers 30 s later, checkpoint or not; a stop before
  torchrun has started exits at once, as a preempted launch;
- exit status: 75 (preemption.PREEMPTED_EXIT_CODE) when the workers checkpointed and stopped early on a
  TERM, HUP or USR1 (a preemption), so a scheduler requeues the job and a rerun resumes; 130
  when they did so on a Ctrl-C (the user's stop: nothing should requeue it); otherwise
  torchrun's;
- a static rendezvous (--master-addr) without --master-port uses DEFAULT_MASTER_PORT.
Nothing here imports torch until it checks the settings (config.py imports the model's and the
data's settings), so `free-port` answers at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ..base.cpus import positive_int, threads_per_rank, usable_cpus
from ..base.preemption import MARKER_ENV, PREEMPTED_EXIT_CODE, STOP_SIGNALS, WORKER_STOP_SIGNAL, exit_status, handles
from ..base.rendezvous import FRESH_STORE_ENV
from ..base.rules import ConfigError, tell_user

DEFAULT_MASTER_PORT = 29622  # a static rendezvous's default: away from the crowded 29500
RESEND_SECONDS = 1.0  # how often workers that torchrun (re)starts after a stop request are looked for
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CPU_PROCESSES = 2  # without GPUs the scripts still run DDP, on gloo
PACKAGE = __package__.split(".")[0]  # not __name__: run as `python -m`, that is __main__
# the entry points whose whole command line is `--config FILE ...` and `section.key=value ...`
SETTINGS_MODULES = (f"{PACKAGE}.train", f"{PACKAGE}.tools.smoke")


class LaunchError(Exception):
    """A launch that cannot work as asked; the message says what to change."""


# the process count a user or an operator asks for; Kubeflow's TrainJob sets PET_NPROC_PER_NODE,
# torchrun's own variable for --nproc-per-node ("auto" and "gpu": one per visible GPU, as here)
PROCESS_COUNT_VARIABLES = ("NPROC_PER_NODE", "PET_NPROC_PER_NODE")
PLANNED_COUNTS = ("auto", "gpu")


def requested_processes(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """(variable, the process count it asks for) of the first one set, or a count of None to plan it here."""
    for name in PROCESS_COUNT_VARIABLES:
        value = environ.get(name, "")
        if value and value not in PLANNED_COUNTS:
            return name, value
    return PROCESS_COUNT_VARIABLES[0], None


def processes_per_node(
    requested: str | None, gpus: int, planned: int | None, variable: str = "NPROC_PER_NODE"
) -> tuple[int, str | None]:
    """(processes to start on this node, a note for the user or None)."""
    if requested:
        count = positive_int(requested)
        if count is None:
            raise LaunchError(f"{variable}={requested!r}: use a positive number of processes")
        if gpus and count > gpus:
            raise LaunchError(
                f"{variable}={count} but this node shows {gpus} GPU(s) (CUDA_VISIBLE_DEVICES, MIG or "
                f"the job's allocation): ranks without a GPU would share one; use {variable}<={gpus}"
            )
        return count, None
    if not gpus:
        return CPU_PROCESSES, f"no GPU visible: {CPU_PROCESSES} CPU processes on gloo"
    if planned and gpus != planned:
        return gpus, f"{gpus} GPU(s) visible, the project was planned for {planned}; using {gpus}"
    return gpus, None


def node_rank_from_job_index(args: list[str], environ: Mapping[str, str]) -> list[str]:
    """A Kubernetes Indexed Job (a JobSet's) numbers its pods in JOB_COMPLETION_INDEX: that is
    the node rank, unless --node-rank or torchrun's PET_NODE_RANK (a TrainJob's) gives one."""
    index = environ.get("JOB_COMPLETION_INDEX", "")
    given = "PET_NODE_RANK" in environ or any(arg.startswith(("--node-rank", "--node_rank")) for arg in args)
    return args if given or not index.isdigit() else [f"--node-rank={index}", *args]


def torchrun_command(args: list[str], processes: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}", *args]


def prepare(args: list[str], environ: Mapping[str, str], gpus: int, affinity: int) -> tuple[list[str], dict]:
    """(torchrun command line, its environment) for this node."""
    planned = positive_int(environ.get("PLANNED_GPUS_PER_NODE"))
    variable, requested = requested_processes(environ)
    processes, note = processes_per_node(requested, gpus, planned, variable)
    args = node_rank_from_job_index(args, environ)
    static = any(arg.startswith(("--master-addr", "--master_addr")) for arg in args)
    if static and not any(arg.startswith(("--master-port", "--master_port")) for arg in args):
        args = [f"--master-port={DEFAULT_MASTER_PORT}", *args]
    env = FRESH_STORE_ENV | dict(environ)  # a c10d rendezvous: a fresh store every round (rendezvous.py)
    env["OMP_NUM_THREADS"] = str(threads_per_rank(environ, processes, usable=affinity))
    if note:
        print(f"launch: {note}", file=sys.stderr, flush=True)
    return torchrun_command(args, processes), env


def settings_arguments(args: list[str]) -> tuple[list[str], list[str]] | None:
    """(--config files, overrides) that the workers' module will read from `args` (torchrun's
    options, `-m MODULE`, the module's arguments), or None where the module is not one of
    SETTINGS_MODULES or its arguments hold another option (--help, say): its own parser answers."""
    if "-m" not in args or args.index("-m") + 1 >= len(args):
        return None
    module, rest = args[args.index("-m") + 1], iter(args[args.index("-m") + 2 :])
    if module not in SETTINGS_MODULES:
        return None
    files, overrides = [], []
    for arg in rest:
        if arg == "--config":
            files.append(next(rest, "-"))
            if files[-1].startswith("-"):  # no file after it: argparse's usage line says so
                return None
        elif arg.startswith("--config="):
            files.append(arg.partition("=")[2])
        elif arg.startswith("-"):
            return None
        else:
            overrides.append(arg)
    return files, overrides


def check_settings(args: list[str]) -> None:
    """Build and check the workers' settings once, as each of them will (train.check_settings, on
    this node's kind of device): a ConfigError here is the one every rank would raise. Each worker
    checks again on its own GPU."""
    given = settings_arguments(args)
    if given is None:
        return
    import torch  # as counting GPUs does next: after the stop handlers

    from .. import config, train
    from ..base.hardware import visible_gpus
    from . import smoke

    files, overrides = config.files(given[0]), given[1]
    smoke_check = args[args.index("-m") + 1] == smoke.__name__
    cfg, sources = smoke.composed(files, overrides) if smoke_check else config.compose(files, overrides)
    train.check_settings(cfg, torch.device("cuda", 0) if visible_gpus() else torch.device("cpu"), sources)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (finished ones not yet reaped too): torchrun's are its workers."""
    if Path("/proc/self/stat").is_file():
        # each process's parent from its stat, not /proc/<pid>/task/<tid>/children: a child moves to
        # another thread's list when the thread that started it ends, and a read of the threads one
        # after the other then misses it (the W&B drill found torchrun with no workers under load)
        found: list[int] = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):  # a process gone meanwhile
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # after "(name)": state, ppid
                    found.append(int(stat.parent.name))
        return found
    try:  # no /proc (macOS)
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    except OSError:
        return []
    return [int(child) for child in found.stdout.split()]


class Supervisor:
    """Runs torchrun; turns stop signals into a checkpoint-and-exit for its workers."""

    def __init__(self, command: list[str], env: dict):
        self.command, self.env, self.stops = command, env, 0
        self.stop_signal: int | None = None  # the first stop signal received
        self.torchrun: subprocess.Popen | None = None
        self.told: set[int] = set()  # workers already sent the stop signal

    def run(self) -> int:
        marker_dir = Path(tempfile.mkdtemp(prefix="preemption-"))
        marker = marker_dir / "preempted"
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._stop)
        try:
            # own session: a Ctrl-C in the terminal reaches only this process, which stops the
            # workers gently; torchrun would forward it as SIGINT, and the workers die of that
            self.torchrun = subprocess.Popen(
                self.command, env={**self.env, MARKER_ENV: str(marker)}, start_new_session=True, preexec_fn=_prepare
            )
            status = self._wait()
            return exit_status(status, self.stop_signal, marker.exists())
        finally:
            shutil.rmtree(marker_dir, ignore_errors=True)

    def _wait(self) -> int:
        while True:
            try:
                return self.torchrun.wait(timeout=RESEND_SECONDS)
            except subprocess.TimeoutExpired:
                if os.getpid() == 1:  # a container's entry: orphans of the pod are ours to collect
                    reap_orphans(keep=self.torchrun.pid)
                if self.stops == 1:
                    self._tell_workers()  # the ones torchrun (re)started since

    def _stop(self, signum, frame) -> None:
        self.stops += 1
        if self.torchrun is None:
            stop_before_start(signum, frame)
        if self.stops == 1:
            self.stop_signal = signum
            print(
                f"launch: {signal.Signals(signum).name}: the workers checkpoint at their next log step and stop; "
                "send it again to stop them now",
                file=sys.stderr,
                flush=True,
            )
            self._tell_workers()
        elif self.stops == 2:
            self.torchrun.terminate()  # torchrun's own shutdown: SIGTERM to the workers, SIGKILL 30 s later

    def _tell_workers(self) -> None:
        """Send the stop signal once to each worker that handles it. Once only: a worker that
        has finished and is shutting down has lost its handler, and would die of a second one;
        not before it handles it: a worker still starting would ignore (or die of) it."""
        for pid in children(self.torchrun.pid):
            if pid not in self.told and handles(pid, WORKER_STOP_SIGNAL):
                self.told.add(pid)
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, WORKER_STOP_SIGNAL)


def stop_before_start(signum, frame) -> None:
    """A stop signal before torchrun runs: nothing has trained in this launch, so nothing is lost;
    exit as a preempted launch does (75, or 130 for Ctrl-C), so the job is requeued or rerun, with
    one line saying so."""
    code = exit_status(0, signum, preempted=True)
    print(
        f"launch: {signal.Signals(signum).name} before training started: nothing ran, nothing to save; "
        f"exit {code} ({'rerun' if signum == signal.SIGINT else 'requeue or rerun'} to start)",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(code)


def reap_orphans(keep: int) -> None:
    """Collect the exit status of finished children other than `keep`. As PID 1 of a container,
    this process inherits every orphan of the pod (the loader workers of a rank that died, say),
    and each would stay a zombie, holding a PID, until the pod ends."""
    for pid in children(os.getpid()):
        if pid != keep:  # torchrun's status is for Popen.wait
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # only if it has finished


def _prepare() -> None:
    """In torchrun, before it starts: survive SIGUSR1 (SLURM delivers it to the whole step; the
    workers inherit the ignore until preemption.PreemptionFlag handles it), and stop with this
    launcher: if it is killed outright, torchrun gets SIGTERM and stops its workers (Linux)."""
    signal.signal(WORKER_STOP_SIGNAL, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def free_port(seed: int, host: str = "") -> int:
    """A free TCP port, derived from `seed` (the job id) so that jobs sharing a head node get
    different ones: with one fixed port, a second job joins the first job's rendezvous store."""
    base = 20000 + seed % 20000
    for port in range(base, base + 200):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise LaunchError(f"no free port in {base}-{base + 199}: set RDZV_PORT")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["free-port"]:
            print(free_port(int(args[1])))
            return 0
        if args[:1] == ["preempted-exit-code"]:
            print(PREEMPTED_EXIT_CODE)
            return 0
        for sig in STOP_SIGNALS:  # before the slow imports: PID 1 of a container drops unhandled signals
            signal.signal(sig, stop_before_start)
        if args[:1] == ["check"]:  # a batch script's one check before it starts the nodes' launchers
            check_settings(args[1:])
            return 0
        check_settings(args)
        from ..base.hardware import visible_gpus

        command, env = prepare(args, os.environ, visible_gpus(), usable_cpus())
    except ConfigError as err:
        return tell_user(err)
    except LaunchError as err:
        print(f"launch error: {err}", file=sys.stderr, flush=True)
        return 2
    return Supervisor(command, env).run()


if __name__ == "__main__":
    sys.exit(main())
