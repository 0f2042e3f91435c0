"""Experiment trackers on global rank 0: Weights & Biases and MLflow, one tracked run per training run.

run.trackers names them: [wandb], [mlflow], both, or [] (TensorBoard is run.tensorboard). Each
is an optional extra (`pip install -e '.[wandb]'`, `'.[mlflow]'`) set up by its own environment
variables: WANDB_API_KEY, WANDB_MODE, WANDB_ENTITY, WANDB_PROJECT; MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME. Only global rank 0 tracks; no other rank starts or imports a tracker.

Each tracker runs in a child process of rank 0 (tools/tracker_worker.py) that is sent the
records of metrics.jsonl over a pipe, so a slow or unreachable service never holds up a step.
Every call must be answered within run.tracker_timeout_s: a tracker that fails or goes quiet
gets one warning and is dropped for the rest of the run. Training, checkpoints and the exit
status never depend on a tracker. The run's end is sent when its log closes (after the stop
checkpoint, on a stop signal), and rank 0 waits for the trackers only after leaving the process
group, at most run.tracker_timeout_s for all of them, so no other rank waits at a barrier.

One tracked run per training run: rank 0 draws an id on the run's first start and keeps it in
out_dir/name/tracking/run.json and in every checkpoint. Every start that resumes from one of the
run's checkpoints (a resume, a requeue, a torchrun restart) continues the same W&B or MLflow
run; a fresh start draws a new id. A resumed attempt replays the steps after its checkpoint:
each tracker is sent only the steps after the last one it took (tracking/<tracker>-<id>.json),
so no step appears twice, and at start the records up to the checkpoint that it never took.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from . import config, extras, processes, records
from .dist import DistInfo
from .rundir import RunDir

WORKER = f"{__package__}.tracker_worker"
ANSWERS_FILE = ".cookiecutter.json"  # the answers this project was made with
# the W&B project / MLflow experiment unless run.tracker_project names one
PROJECT = "{{ cookiecutter.project_slug }}"
EXIT = "its exit after finishing"  # the last thing a tracker's process owes rank 0


def check(names: list[str]) -> None:
    """On every rank, before any collective: each tracker run.trackers names is installed."""
    for name in names:
        if not extras.installed(name):
            raise extras.missing(name, f"run.trackers={names}")


def tracked_run_id(run_dir: RunDir, resumed: Path | None, saved: str | None) -> str:
    """The tracked-run id of this start: a resume from one of this run's own checkpoints continues
    the id it carries (or tracking/run.json's, when the run had no tracker named before); a fresh
    start, or one from another run's checkpoint, draws a new one. Kept in tracking/run.json."""
    path = run_dir.tracking / "run.json"
    own = resumed is not None and run_dir.holds(resumed)
    run_id = (saved or (json.loads(path.read_text())["id"] if path.exists() else None)) if own else None
    run_id = run_id or uuid.uuid4().hex[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": run_id}) + "\n")
    return run_id


def missed(run_dir: RunDir, name: str, run_id: str, first_step: int) -> list[dict]:
    """The train and eval records up to `first_step` that tracker `name` never took (an earlier
    attempt ended before sending them, or the tracker was named only now), from metrics.jsonl."""
    taken_path = taken_file(run_dir, name, run_id)
    if not run_dir.metrics.exists():
        return []
    taken = json.loads(taken_path.read_text()) if taken_path.exists() else {}
    timeline = records.current_timeline(records.read(run_dir.metrics))
    return [
        record
        for record in timeline
        if record["kind"] in (records.TRAIN, records.EVAL)
        and taken.get(record["kind"], -1) < record["step"] <= first_step
    ]


def taken_file(run_dir: RunDir, name: str, run_id: str) -> Path:
    """Where tracker `name`'s process keeps the last step of each kind it took for run `run_id`."""
    return run_dir.tracking / f"{name}-{run_id}.json"


def without_credentials(text: str) -> str:
    """URLs in `text` without their user:password@ part."""
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1", text)


def destination(name: str) -> str:
    """Where a tracker sends its runs, as its environment says, for messages."""
    if name == "mlflow":
        return f"MLflow at {os.environ.get('MLFLOW_TRACKING_URI', 'its default store (./mlflow.db)')}"
    mode = os.environ.get("WANDB_MODE", "online")
    return f"W&B {mode}" + (f" at {os.environ['WANDB_BASE_URL']}" if "WANDB_BASE_URL" in os.environ else "")


def project_root() -> Path:
    """The project's directory (where its answers file is): the source tree's, else the current one."""
    source_root = Path(__file__).resolve().parents[2]  # src/<package>/tracking.py
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


class TrackerProcess:
    """One tracker's child process. `call` queues a message and returns at once; the child
    answers each message in order. A message unanswered after `timeout` seconds, an error, or
    the child's exit drops the tracker with one warning."""

    def __init__(self, name: str, timeout: float):
        self.name, self.timeout = name, timeout
        command, env = processes.module_command(WORKER, name, str(timeout))
        self.process = subprocess.Popen(
            command,
            env=env,
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
        self._send_later({"op": op, **message}, what)

    def finish(self, status: str, checkpoint: str | None) -> None:
        """Ask the child to end the tracked run and exit; `wait` waits for both."""
        # the exit is answered by the end of its output; then its input closes
        self._send_later({"op": "finish", "status": status, "checkpoint": checkpoint}, "finish", EXIT, then_close=True)

    def _send_later(self, message: dict, *answers_owed: str, then_close: bool = False) -> None:
        if self.dropped or self._check():
            return
        if not self.unanswered:
            self.since = time.monotonic()
        self.unanswered.extend(answers_owed)
        self.outbox.put(message)  # encoded by the sender thread, off the training step
        if then_close:
            self.outbox.put(None)

    def wait(self, deadline: float) -> None:
        """Until the child has answered everything and exited, or it fails, overruns a call's
        limit or reaches `deadline` (time.monotonic())."""
        while not self.dropped and not self._check() and self.unanswered:
            if time.monotonic() > deadline:
                self._drop(f"no answer to {self.unanswered[0]} before the trackers' end of run.tracker_timeout_s")
                return
            time.sleep(0.02)
        if not self.dropped:
            try:
                self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._drop("its process did not exit after finishing")

    def _check(self) -> bool:
        """Drop the tracker if it failed or overran; True when it is dropped."""
        if self.failure is not None:
            self._drop(self.failure)
        elif self.unanswered and time.monotonic() - self.since > self.timeout:
            self._drop(
                f"no answer to {self.unanswered[0]} within run.tracker_timeout_s={self.timeout:g} s "
                f"({destination(self.name)})"
            )
        return self.dropped

    def _drop(self, problem: str) -> None:
        if not self.dropped:
            self.dropped = True
            cause = without_credentials(problem).rstrip(".")
            sys.stderr.write(
                f"warning: tracker {self.name} dropped: {cause}; training goes on without it "
                "(metrics.jsonl keeps every record)\n"
            )
            self._kill()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # its session: W&B's service process too
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _send(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self.process.stdin.write(json.dumps(message) + "\n")
                self.process.stdin.flush()
            except OSError:  # the child is gone; _receive says why
                return
        with contextlib.suppress(OSError):
            self.process.stdin.close()

    def _receive(self) -> None:
        for line in self.process.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                answer = {"error": f"an unreadable answer {line.strip()[:200]!r}"}
            if "error" in answer:
                self.failure = answer["error"]
                return
            if "note" in answer:
                sys.stderr.write(f"tracker {self.name}: {without_credentials(answer['note'])}\n")
            self.unanswered.popleft()
            self.since = time.monotonic()
        if self.unanswered and self.unanswered[0] == EXIT:
            self.unanswered.popleft()
        else:
            waiting = self.unanswered[0] if self.unanswered else "its next message"
            self.failure = f"its process ended (exit code {self.process.wait()}) before answering {waiting}"


class Trackers:
    """Rank 0's trackers for one training run: made empty, started by `start` (on rank 0, for
    run.trackers), sent every metrics.jsonl record by `write`, told the run's end by `end` and
    waited for by `wait`, which train.main calls after leaving the process group, so that no rank
    waits for them at a barrier."""

    def __init__(self):
        self.processes: list[TrackerProcess] = []
        self.timeout, self.upload_checkpoint, self.ended = 0.0, False, False

    def start(self, cfg, info: DistInfo, resumed: Path | None, state) -> str | None:
        """Start the trackers for a run at `state` (a TrainState, resumed or fresh) and send each
        the records it missed; returns the tracked-run id (elsewhere than rank 0, or with no
        trackers: the id the resumed checkpoint carried)."""
        if not info.is_main or not cfg.run.trackers:
            return state.tracked_run_id
        run_id = tracked_run_id(cfg.run_dir, resumed, state.tracked_run_id)
        self.timeout, self.upload_checkpoint = cfg.run.tracker_timeout_s, cfg.run.tracker_checkpoint
        start = {
            "id": run_id,
            "name": cfg.run.name,
            "project": cfg.run.tracker_project or PROJECT,
            "run_dir": str(cfg.run_dir.root.resolve()),
            "root": str(project_root()),
            "timeout": self.timeout,
            "config": config.to_dict(cfg),
            "facts": run_facts(info),
        }
        for name in cfg.run.trackers:
            process = TrackerProcess(name, self.timeout)
            process.call("start", "start", **start)
            for record in missed(cfg.run_dir, name, run_id, state.step) if state.step else []:  # fresh: none
                process.call("log", f"the missed {record['kind']} record of step {record['step']}", record=record)
            self.processes.append(process)
        return run_id

    def write(self, record: dict) -> None:
        for process in self.processes:
            process.call("log", f"the {record['kind']} record of step {record['step']}", record=record)

    def end(self, status: str, checkpoint: Path | None = None) -> None:
        """Tell every tracker the run ended ("finished", "preempted" or "failed"); returns at once."""
        if self.ended:
            return
        self.ended = True
        upload = str(checkpoint) if checkpoint is not None and self.upload_checkpoint else None
        for process in self.processes:
            process.finish(status, upload)

    def wait(self) -> None:
        """Until every tracker has finished, within run.tracker_timeout_s for all of them together."""
        self.end("failed")  # a no-op after the log's own end; else the run stopped before its log did
        busy = [process for process in self.processes if not process.dropped and process.unanswered]
        if busy:
            print(f"finishing the trackers (at most {self.timeout:g} s)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self.timeout
        for process in busy:
            process.wait(deadline)
