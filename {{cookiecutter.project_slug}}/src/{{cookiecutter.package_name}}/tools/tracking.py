"""Experiment trackers on global rank 0: Weights & Biases and MLflow, one tracked run per training run.

run.trackers names them: [wandb], [mlflow], both, or [] (TensorBoard is run.tensorboard). Each
is an optional extra (`pip install -e '.[wandb]'`, `'.[mlflow]'`) set up by its own environment
variables: WANDB_API_KEY, WANDB_MODE, WANDB_ENTITY, WANDB_PROJECT; MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME. Only global rank 0 tracks; no other rank starts or imports a tracker.

Each tracker runs in a child process of rank 0 (tools/tracker_worker.py) that is sent the
records of metrics.jsonl over a pipe, so a slow or unreachable service never holds up a step.
Every call must be answered within run.tracker_timeout_s: a tracker that fails or goes quiet
gets one warning and is dropped for the rest of the run. Training, checkpoints and the exit
status never depend on a tracker. On a stop signal the loop writes its checkpoint first and
finishes the trackers after, within the same limit.

One tracked run per training run: rank 0 draws an id on the run's first start and keeps it in
out_dir/name/tracking/run.json and in every checkpoint. Every later start of that run (a resume,
a requeue, a torchrun restart) continues the same W&B run or MLflow run. A resumed attempt
replays the steps after its checkpoint; each tracker is sent only the steps after the last one
it took (kept in tracking/<tracker>.json), so no step appears twice.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from .. import config
from ..dist import DistInfo
from ..rules import ConfigError

TRACKERS = ("wandb", "mlflow")
WORKER = f"{__package__}.tracker_worker"
ANSWERS_FILE = ".cookiecutter.json"  # the answers this project was made with
# the W&B project / MLflow experiment unless run.tracker_project names one
PROJECT = "{{ cookiecutter.project_slug }}"
EXIT = "its exit after finishing"  # the last thing a tracker's process owes rank 0


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def check(names: list[str]) -> None:
    """On every rank, before any collective: each tracker run.trackers names is installed."""
    for name in names:
        if not installed(name):
            raise ConfigError(
                f"run.trackers: {name} is not installed; pip install -e '.[{name}]', or remove it from run.trackers"
            )


def tracking_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "tracking"


def tracked_run_id(run_dir: Path, resumed: Path | None, saved: str | None) -> str:
    """The run's tracked-run id: tracking/run.json's, else the one the resumed checkpoint carries
    when it is one of this run's, else a new one; kept in tracking/run.json."""
    path = tracking_dir(run_dir) / "run.json"
    if path.exists():
        return json.loads(path.read_text())["id"]
    own_checkpoint = resumed is not None and Path(resumed).resolve().parent.parent == Path(run_dir).resolve()
    run_id = saved if own_checkpoint and saved else uuid.uuid4().hex[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": run_id}) + "\n")
    return run_id


def project_root() -> Path:
    """The project's directory (where its answers file is): the source tree's, else the current one."""
    source_root = Path(__file__).resolve().parents[3]  # src/<package>/tools/tracking.py
    return source_root if (source_root / ANSWERS_FILE).exists() else Path.cwd()


def run_facts(info: DistInfo) -> dict:
    """Where and on what the run trains: for the trackers' config, beside the settings."""
    device = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else platform.processor() or "cpu"
    return {
        "world_size": info.world_size,
        "nodes": max(1, info.world_size // info.local_world_size),
        "device": f"{info.world_size} x {device} (as rank 0 sees it)",
        "torch": torch.__version__,
    }


def worker_env() -> dict:
    """This environment, with this package importable however this process found it."""
    source = str(Path(__file__).resolve().parents[2])  # the directory that holds the package
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}


class TrackerProcess:
    """One tracker's child process. `call` queues a message and returns at once; the child
    answers each message in order, and a message unanswered after `timeout` seconds, an error,
    or the child's exit drops the tracker with one warning."""

    def __init__(self, name: str, timeout: float):
        self.name, self.timeout = name, timeout
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER, name],
            env=worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a terminal's Ctrl-C is for rank 0, which finishes the tracker
        )
        self.unanswered: collections.deque[str] = collections.deque()  # what each waiting message asks
        self.since = time.monotonic()  # when the oldest unanswered message became the child's work
        self.failure: str | None = None
        self.dropped = False
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send, daemon=True).start()
        threading.Thread(target=self._receive, daemon=True).start()

    def call(self, op: str, what: str, **message) -> None:
        if self.dropped or self._check():
            return
        if not self.unanswered:
            self.since = time.monotonic()
        self.unanswered.append(what)
        self.outbox.put(json.dumps({"op": op, **message}))

    def finish(self, status: str, checkpoint: str | None) -> None:
        """Ask the child to end the tracked run and exit; `wait` waits for both."""
        self.call("finish", "finish", status=status, timeout=self.timeout, checkpoint=checkpoint)
        if not self.dropped:
            self.unanswered.append(EXIT)  # answered by the end of its output
            self.outbox.put(None)  # then close its input

    def wait(self) -> None:
        """Until the child has answered everything and exited, or it fails or overruns its limit."""
        while not self.dropped and not self._check() and self.unanswered:
            time.sleep(0.02)
        if not self.dropped:
            try:
                self.process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._kill()

    def _check(self) -> bool:
        """Drop the tracker if it failed or overran; True when it is dropped."""
        problem = self.failure
        if problem is None and self.unanswered and time.monotonic() - self.since > self.timeout:
            problem = f"no answer to {self.unanswered[0]} within run.tracker_timeout_s={self.timeout:g} s"
        if problem is not None and not self.dropped:
            self.dropped = True
            sys.stderr.write(
                f"warning: tracker {self.name} dropped: {problem}; training goes on without it "
                "(metrics.jsonl keeps every record)\n"
            )
            self._kill()
        return self.dropped

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # its session: W&B's service process too
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _send(self) -> None:
        while (line := self.outbox.get()) is not None:
            try:
                self.process.stdin.write(line + "\n")
                self.process.stdin.flush()
            except OSError:  # the child is gone; _receive says why
                return
        self.process.stdin.close()

    def _receive(self) -> None:
        for line in self.process.stdout:
            answer = json.loads(line)
            if "error" in answer:
                self.failure = answer["error"]
                return
            self.unanswered.popleft()
            self.since = time.monotonic()
        if self.unanswered and self.unanswered[0] == EXIT:
            self.unanswered.popleft()
        elif self.unanswered:
            self.failure = f"its process ended (exit code {self.process.wait()}) before answering {self.unanswered[0]}"


class Trackers:
    """Rank 0's trackers: `write` sends a metrics.jsonl record to each, `close` ends their runs."""

    def __init__(self, names: list[str], start: dict, timeout: float, upload_checkpoint: bool):
        self.upload_checkpoint = upload_checkpoint
        self.processes = [TrackerProcess(name, timeout) for name in names]
        for process in self.processes:
            process.call("start", "start", **start)

    def write(self, record: dict) -> None:
        for process in self.processes:
            process.call("log", f"the {record['kind']} record of step {record['step']}", record=record)

    def close(self, status: str, checkpoint: Path | None = None) -> None:
        """Finish every tracked run ("finished", "preempted" or "failed"), all at once."""
        upload = str(checkpoint) if checkpoint is not None and self.upload_checkpoint else None
        for process in self.processes:
            process.finish(status, upload)
        for process in self.processes:
            process.wait()


def open_trackers(cfg, info: DistInfo, resumed: Path | None, saved_id: str | None):
    """Rank 0's trackers for run.trackers and the tracked-run id; elsewhere, or with no trackers,
    None and the id the resumed checkpoint carried."""
    if not info.is_main or not cfg.run.trackers:
        return None, saved_id
    run_id = tracked_run_id(cfg.run_dir, resumed, saved_id)
    start = {
        "id": run_id,
        "name": cfg.run.name,
        "project": cfg.run.tracker_project or PROJECT,
        "run_dir": str(cfg.run_dir.resolve()),
        "root": str(project_root()),
        "timeout": cfg.run.tracker_timeout_s,
        "config": config.to_dict(cfg),
        "facts": run_facts(info),
    }
    return Trackers(cfg.run.trackers, start, cfg.run.tracker_timeout_s, cfg.run.tracker_checkpoint), run_id
