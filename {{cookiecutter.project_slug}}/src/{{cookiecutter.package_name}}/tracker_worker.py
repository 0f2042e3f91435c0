"""One experiment tracker's process, started and fed by rank 0 (see tracking.py).

    python -m {{ cookiecutter.package_name }}.tracker_worker wandb|mlflow TIMEOUT_S

Reads one JSON message a line on stdin (start, then the records of metrics.jsonl, then finish),
calls W&B or MLflow, and answers each line on stdout in order: {"ok": true}, or {"error": ...}
and exit. Stop signals are ignored: rank 0 finishes the tracked run after its stop checkpoint.
If rank 0 disappears (its pipe closes, or this process is orphaned), the tracked run is marked
failed and this process ends within the time limit, even if a call hangs. One process at a
time serves a tracker of a run directory (a lock), so a restarted rank 0's tracker waits for
the one its predecessor left. Imports neither torch nor the training code.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .preemption import PREEMPTED_EXIT_CODE
from .records import scalars
from .rundir import RunDir

ID_TAG = "tracked_run_id"  # MLflow: the tag that finds a training run's MLflow run again
MLFLOW_STATUS = {"finished": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}
CLOSED = None  # what the reader thread queues when rank 0's pipe closes


def git_commit(root: str) -> str | None:
    """The project's commit, "-dirty" when its files differ from it; None outside git."""
    try:
        commit, changes = (
            subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
            for args in (["rev-parse", "HEAD"], ["status", "--porcelain"])
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("-dirty" if changes.stdout.strip() else "")


def run_params(start: dict) -> dict:
    """What the run is: its settings, the project's answers, its commit, and where it trains."""
    answers = Path(start["root"]) / ".cookiecutter.json"
    made_with = json.loads(answers.read_text()).get("cookiecutter", {}) if answers.exists() else {}
    return {"config": start["config"], "project": made_with, "git_commit": git_commit(start["root"]), **start["facts"]}


def flat(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 0.001}} -> {"optim.lr": "0.001"}: MLflow's params are flat strings."""
    items = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            items |= flat(value, f"{prefix}{key}.")
        else:
            items[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return items


class Tracker:
    """What both trackers share: the steps already taken, so a resumed attempt's replay of the
    steps after its checkpoint is not sent twice."""

    def __init__(self, start: dict):
        directory = RunDir(start["run_dir"]).tracking
        directory.mkdir(parents=True, exist_ok=True)
        self.lock = open(directory / f"{self.NAME}.lock", "w")  # noqa: SIM115 (held for the process's life)
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.taken_path = directory / f"{self.NAME}-{start['id']}.json"
        self.taken = json.loads(self.taken_path.read_text()) if self.taken_path.exists() else {}
        self.note = ""  # where the run is tracked, for rank 0's console

    def log(self, logged: list[dict]) -> None:
        """Send records in order, in as few calls as the tracker allows; skip the steps an
        earlier attempt sent (a replay after resuming)."""
        rows: list[tuple[int, dict[str, float]]] = []
        for record in logged:
            kind, step = record["kind"], record["step"]
            if kind == "summary":
                self.metrics(rows)
                rows = []
                self.summary(record["summary"], step)
            elif step > self.taken.get(kind, -1):
                rows.append((step, scalars(record)))
                self.taken[kind] = step
        self.metrics(rows)
        partial = self.taken_path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.taken))
        os.replace(partial, self.taken_path)


class Wandb(Tracker):
    """A W&B run with the tracked-run id; "step" (the optimizer step) is every metric's x-axis,
    so W&B's own step counter, which drops a step lower than its last, never decides."""

    NAME = "wandb"

    def __init__(self, start: dict):
        super().__init__(start)
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or start["project"],
            id=start["id"],
            name=start["name"],
            resume="allow",
            dir=start["run_dir"],
            settings=wandb.Settings(init_timeout=0.8 * start["timeout"]),  # W&B's own error, before rank 0's limit
        )
        self.run.config.update(run_params(start), allow_val_change=True)
        self.note = f"run {self.run.id} of project {self.run.project}, " + (
            f"offline in {self.run.dir}" if self.run.offline else self.run.url
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self.run.log({"step": step, **values})

    def summary(self, values: dict, step: int) -> None:
        self.run.summary.update(values)

    def finish(self, status: str, checkpoint: str | None) -> None:
        if checkpoint is not None:
            artifact = self.wandb.Artifact(re.sub(r"[^\w.-]", "-", f"{self.run.name}-checkpoint"), type="model")
            if Path(checkpoint).is_dir():  # a sharded checkpoint: every rank's part
                artifact.add_dir(checkpoint, name=Path(checkpoint).name)
            else:
                artifact.add_file(checkpoint)
            self.run.log_artifact(artifact)
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code={"finished": 0, "preempted": PREEMPTED_EXIT_CODE}.get(status, 1))


class Mlflow(Tracker):
    """An MLflow run tagged with the tracked-run id, found again by that tag on every start."""

    NAME = "mlflow"

    def __init__(self, start: dict):
        super().__init__(start)
        # MLflow's own error well before rank 0's limit: by default a closed port costs 7 retries
        # (about 4 minutes) and a server that never answers 2 minutes a try. Three tries of a sixth
        # of the limit each and one back-off sleep of about a tenth (urllib3 sleeps 0, then twice
        # the factor; MLflow adds up to 1 s of jitter to each) leave room for MLflow's import on a
        # loaded machine; these are per request, so run.tracker_timeout_s bounds the whole call
        limit = start["timeout"]
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(limit // 6))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", str(int(limit // 20)))
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.Param = Metric, Param
        self.client = MlflowClient()  # MLFLOW_TRACKING_URI, else MLflow's default store
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or start["project"]
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        found = self.client.search_runs([experiment_id], f"tags.{ID_TAG} = '{start['id']}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            created = self.client.create_run(experiment_id, run_name=start["name"], tags={ID_TAG: start["id"]})
            self.run_id = created.info.run_id
        self.log_params(flat(run_params(start)), found[0].data.params if found else {})
        self.note = f"run {self.run_id} of experiment {name} at {self.client.tracking_uri}"

    def log_params(self, params: dict[str, str], logged: dict[str, str]) -> None:
        """New params; MLflow refuses to change one, so a resume's changed settings become a tag."""
        new = [self.Param(key, value[:6000]) for key, value in params.items() if key not in logged]
        for first in range(0, len(new), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=new[first : first + 100])
        changed = [f"{key}: {logged[key]} -> {new}" for key, new in params.items() if logged.get(key, new) != new]
        if changed:
            self.client.set_tag(self.run_id, f"changed_on_resume_{int(time.time())}", "; ".join(changed)[:5000])

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        now = int(time.time() * 1000)
        batch = [
            self.Metric(key, value, now, step)
            for step, values in rows
            for key, value in values.items()
            if math.isfinite(value)
        ]
        for first in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[first : first + 1000])

    def summary(self, values: dict, step: int) -> None:
        numbers = {f"summary/{key}": value for key, value in values.items() if isinstance(value, (int, float))}
        self.metrics([(step, numbers)])

    def finish(self, status: str, checkpoint: str | None) -> None:
        if checkpoint is not None:
            if Path(checkpoint).is_dir():  # a sharded checkpoint: every rank's part
                self.client.log_artifacts(self.run_id, checkpoint, artifact_path=f"checkpoints/{Path(checkpoint).name}")
            else:
                self.client.log_artifact(self.run_id, checkpoint, artifact_path="checkpoints")
        self.client.set_terminated(self.run_id, MLFLOW_STATUS[status])


TRACKERS = {tracker.NAME: tracker for tracker in (Wandb, Mlflow)}


def serve(tracker_class, answers, timeout: float) -> int:
    """Answer rank 0's messages until its finish, or until rank 0 is gone. Records that queued
    up while the tracker was busy go out in one call, so a slow store keeps up with the log."""
    inbox, waiting, tracker = incoming(sys.stdin), [], None
    while (message := waiting.pop() if waiting else inbox.get()) is not CLOSED:
        batch = [message]
        while message["op"] == "log" and not waiting:
            try:
                following = inbox.get_nowait()
            except queue.Empty:
                break
            (batch if following is not CLOSED and following["op"] == "log" else waiting).append(following)
        try:
            if message["op"] == "start":
                tracker = tracker_class(message)
            elif message["op"] == "log":
                tracker.log([queued["record"] for queued in batch])
            else:
                tracker.finish(message["status"], message["checkpoint"])
        except Exception as error:  # reported to rank 0, which drops this tracker
            answer(answers, {"error": f"{type(error).__name__}: {error}".splitlines()[0][:500]})
            return 1
        note = tracker.note if message["op"] == "start" else ""
        if not all(answer(answers, {"ok": True} | ({"note": note} if note else {})) for _ in batch):
            break  # rank 0 is gone
        if message["op"] == "finish":
            return 0
    if tracker is not None:  # rank 0 ended without finishing: killed, or its node lost
        signal.alarm(max(1, math.ceil(timeout)))  # the default action ends this process
        tracker.finish("failed", None)
    return 0


def incoming(stream) -> queue.SimpleQueue:
    """Rank 0's messages, parsed by a thread as they arrive; CLOSED when its pipe closes."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        for line in stream:
            inbox.put(json.loads(line))
        inbox.put(CLOSED)

    threading.Thread(target=read, daemon=True).start()
    return inbox


def answer(answers, message: dict) -> bool:
    """Write one answer to rank 0; False when rank 0 is gone."""
    try:
        answers.write(json.dumps(message) + "\n")
        return True
    except OSError:
        return False


def end_when_orphaned(timeout: float) -> None:
    """If rank 0 dies while a call hangs, nothing reads stdin again: end within `timeout` of it."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    signal.alarm(max(1, math.ceil(timeout)))


def main(argv=None) -> int:
    name, timeout = sys.argv[1:] if argv is None else argv
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(stop, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the libraries' prints go to stderr, not into the answers
    threading.Thread(target=end_when_orphaned, args=(float(timeout),), daemon=True).start()
    return serve(TRACKERS[name], answers, float(timeout))


if __name__ == "__main__":
    sys.exit(main())
