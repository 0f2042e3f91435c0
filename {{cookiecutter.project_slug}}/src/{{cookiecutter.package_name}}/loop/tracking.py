"""Experiment trackers on global rank 0: Weights & Biases and MLflow (run.trackers), each set up by
its own environment variables and installed as an extra; no other rank starts or imports one.

Each tracker works on a thread of its own: the loop hands it each record of metrics.jsonl and never
waits. A call that fails, or runs longer than run.tracker_timeout_s, drops the tracker with one
warning; training, checkpoints and the exit status never depend on one. One tracked run per
training run: its id is kept in tracking/run.json and every checkpoint, so a resume or a requeue
continues it, and each tracker takes every step once (tracking/<tracker>-<id>.json holds the last
it took; a resumed start sends it what it missed). docs/observability.md tells the whole story.
"""

from __future__ import annotations

import json
import math
import os
import platform
import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from .. import config
from ..base import extras, records
from ..base.dist import DistInfo
from ..base.preemption import PREEMPTED_EXIT_CODE
from ..base.rundir import RunDir

PROJECT = "{{ cookiecutter.project_slug }}"  # the W&B project / MLflow experiment unless run.tracker_project
ID_TAG = "tracked_run_id"  # MLflow: the tag that finds a training run's MLflow run again
MLFLOW_STATUS = {"finished": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}


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


def timeline_up_to(run_dir: RunDir, step: int) -> list[dict]:
    """The train and eval records of metrics.jsonl up to `step` on the run's current timeline: what
    a resumed start sends each tracker, which skips the steps it took before."""
    if not step or not run_dir.metrics.exists():
        return []
    timeline = records.current_timeline(records.read(run_dir.metrics))
    return [r for r in timeline if r["kind"] in (records.TRAIN, records.EVAL) and r["step"] <= step]


def flat(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 0.001}} -> {"optim.lr": "0.001"}: MLflow's params are flat strings."""
    items = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            items |= flat(value, f"{prefix}{key}.")
        else:
            items[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return items


def run_params(cfg, info: DistInfo) -> dict:
    """What the run is: its settings and where it trains (the tracker's thread adds the project's commit)."""
    device = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else platform.processor() or "cpu"
    return {
        "config": config.to_dict(cfg),
        "world_size": info.world_size,
        "nodes": max(1, info.world_size // info.local_world_size),
        "device": f"{info.world_size} x {device} (as rank 0 sees it)",
        "torch": torch.__version__,
    }


def git_commit(root: Path) -> str | None:
    """The commit of the repository holding `root`, "-dirty" when its files differ from it; None outside git."""
    try:
        commit, changes = (
            subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
            for args in (["rev-parse", "HEAD"], ["status", "--porcelain"])
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return commit.stdout.strip() + ("-dirty" if changes.stdout.strip() else "") if commit.returncode == 0 else None


class Wandb:
    """A W&B run with the tracked-run id; "step" (the optimizer step) is every metric's x-axis."""

    def __init__(self, start: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or start["project"],
            id=start["id"],
            name=start["name"],
            resume="allow",
            dir=start["run_dir"],
            # W&B's own error before rank 0's limit; no console capture: rank 0's prints never wait for W&B
            settings=wandb.Settings(init_timeout=0.8 * start["timeout"], console="off"),
        )
        self.run.config.update(start["params"], allow_val_change=True)  # a resume's changed settings too
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        where = f"offline in {self.run.dir}" if self.run.offline else self.run.url
        self.note = f"run {self.run.id} of project {self.run.project}, {where}"

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


class Mlflow:
    """An MLflow run tagged with the tracked-run id, found again by that tag on every start."""

    def __init__(self, start: dict):
        # MLflow's own error well before rank 0's limit: by default a closed port costs 7 retries
        # (minutes); three tries of a sixth of the limit, back-off sleeps of a tenth (and MLflow's
        # jitter of up to 1 s) bound each request within run.tracker_timeout_s
        limit = start["timeout"]
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(limit // 6))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", str(int(limit // 20)))
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric, self.client = Metric, MlflowClient()  # MLFLOW_TRACKING_URI, else MLflow's default store
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
        # new params only: MLflow refuses to change one, so a resume's changed settings become a tag
        logged, params = found[0].data.params if found else {}, flat(start["params"])
        new = [Param(key, value[:6000]) for key, value in params.items() if key not in logged]
        for first in range(0, len(new), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=new[first : first + 100])
        changed = [f"{key}: {logged[key]} -> {new}" for key, new in params.items() if logged.get(key, new) != new]
        if changed:
            self.client.set_tag(self.run_id, f"changed_on_resume_{int(time.time())}", "; ".join(changed)[:5000])
        self.note = f"run {self.run_id} of experiment {name} at {self.client.tracking_uri}"

    def metrics(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        now = int(time.time() * 1000)
        batch = [self.Metric(k, v, now, step) for step, values in rows for k, v in values.items() if math.isfinite(v)]
        for first in range(0, len(batch), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=batch[first : first + 1000])

    def summary(self, values: dict, step: int) -> None:
        self.metrics([(step, {f"summary/{k}": v for k, v in values.items() if isinstance(v, (int, float))})])

    def finish(self, status: str, checkpoint: str | None) -> None:
        if checkpoint is not None:
            folder = f"checkpoints/{Path(checkpoint).name}" if Path(checkpoint).is_dir() else "checkpoints"
            log = self.client.log_artifacts if Path(checkpoint).is_dir() else self.client.log_artifact
            log(self.run_id, checkpoint, artifact_path=folder)  # a sharded checkpoint: every rank's part
        self.client.set_terminated(self.run_id, MLFLOW_STATUS[status])


SERVICES = {"wandb": Wandb, "mlflow": Mlflow}


class Tracker:
    """One tracker on a thread of its own. `send` queues a record, or the run's end (status,
    checkpoint to upload), and returns at once. A call that raises, or that still runs `timeout`
    seconds after it began when the loop looks (at each record and at the end), drops the tracker."""

    def __init__(self, name: str, start: dict, service=None):
        self.name, self.timeout = name, start["timeout"]
        # the last step of each kind it took in this tracked run
        self.taken_path = RunDir(start["run_dir"]).tracking / f"{name}-{start['id']}.json"
        self.taken = json.loads(self.taken_path.read_text()) if self.taken_path.exists() else {}
        self.taken_path.parent.mkdir(parents=True, exist_ok=True)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.busy: tuple[float, str] | None = None  # since when, and what, the call in progress
        self.dropped, self.done = False, threading.Event()
        serve = (service or SERVICES[name], start)
        threading.Thread(target=self._serve, args=serve, daemon=True, name=f"tracker-{name}").start()

    def send(self, item: dict | tuple) -> None:
        if not self.dropped and not self.overran():
            self.inbox.put(item)

    def overran(self) -> bool:
        busy = self.busy
        if busy is not None and time.monotonic() - busy[0] > self.timeout:
            self.drop(f"no answer to {busy[1]} within run.tracker_timeout_s={self.timeout:g} s")
        return self.dropped

    def drop(self, problem: str) -> None:
        if not self.dropped:
            self.dropped = True
            cause = re.sub(r"(\w+://)[^/@\s]+@", r"\1", problem).rstrip(".")  # no user:password@ of a URL
            warning = f"warning: tracker {self.name} dropped: {cause}; training goes on without it"
            print(f"{warning} (metrics.jsonl keeps every record)", file=sys.stderr, flush=True)

    def wait(self, deadline: float) -> bool:
        """Until the tracker finished, is dropped or `deadline` (time.monotonic()) passed; whether
        its thread is idle (a dropped tracker's call may still hang)."""
        while not self.done.is_set() and not self.overran() and time.monotonic() < deadline:
            self.done.wait(0.05)
        if not self.done.is_set():
            self.drop("no answer before the trackers' end of run.tracker_timeout_s")
        return self.done.is_set()

    def _serve(self, service, start: dict) -> None:
        try:
            start = start | {"params": start["params"] | {"git_commit": git_commit(Path(__file__).parent)}}
            service = self._call("start", service, start)
            print(f"tracker {self.name}: {service.note}", file=sys.stderr, flush=True)
            while not self.dropped:
                batch = [self.inbox.get()]
                while isinstance(batch[-1], dict) and not self.inbox.empty():  # what queued up: one call
                    batch.append(self.inbox.get())
                logged = [item for item in batch if isinstance(item, dict)]
                if logged:
                    what = f"the {logged[-1]['kind']} record of step {logged[-1]['step']}"
                    self._call(what, self.log, service, logged)
                if isinstance(batch[-1], tuple):
                    return self._call("the run's end", service.finish, *batch[-1])
        except Exception as error:
            self.drop(f"{type(error).__name__}: {error}".splitlines()[0][:500])
        finally:
            self.done.set()

    def _call(self, what: str, function, *args):
        self.busy = (time.monotonic(), what)
        result = function(*args)
        self.busy = None
        return result

    def log(self, service, logged: list[dict]) -> None:
        """Records in order, in as few calls as the tracker allows, without the steps it took before."""
        rows: list[tuple[int, dict[str, float]]] = []
        taken = dict(self.taken)  # what the tracker has once its calls return: a resume replays the rest
        for record in logged:
            if record["kind"] == records.SUMMARY:
                service.metrics(rows)
                rows = []
                service.summary(record["summary"], record["step"])
            elif record["step"] > taken.get(record["kind"], -1):
                rows.append((record["step"], records.scalars(record)))
                taken[record["kind"]] = record["step"]
        service.metrics(rows)
        self.taken = taken
        self.taken_path.with_suffix(".tmp").write_text(json.dumps(self.taken))
        os.replace(self.taken_path.with_suffix(".tmp"), self.taken_path)


class Trackers:
    """Rank 0's trackers for one training run: `start` (on rank 0, for run.trackers), `write` every
    record of metrics.jsonl, `end`, and `wait`, which train.main calls after leaving the group."""

    def __init__(self):
        self.trackers: list[Tracker] = []
        self.timeout, self.upload_checkpoint, self.ended = 0.0, False, False

    def start(self, cfg, info: DistInfo, resumed: Path | None, state) -> str | None:
        """Start the trackers for a run at `state` (a TrainState) and queue each the records it
        missed; returns the tracked-run id (elsewhere than rank 0, or with no trackers: the id the
        resumed checkpoint carried)."""
        if not info.is_main or not cfg.run.trackers:
            return state.tracked_run_id
        run_id = tracked_run_id(cfg.run_dir, resumed, state.tracked_run_id)
        self.timeout, self.upload_checkpoint = cfg.run.tracker_timeout_s, cfg.run.tracker_checkpoint
        start = {
            "id": run_id,
            "name": cfg.run.name,
            "project": cfg.run.tracker_project or PROJECT,
            "run_dir": str(cfg.run_dir.root.resolve()),
            "timeout": self.timeout,
            "params": run_params(cfg, info),
        }
        for name in cfg.run.trackers:
            self.trackers.append(Tracker(name, start))
            for record in timeline_up_to(cfg.run_dir, state.step):  # what it never took goes out
                self.trackers[-1].send(record)
        return run_id

    def write(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.send(record)

    def end(self, status: str, checkpoint: Path | None = None) -> None:
        """Tell every tracker the run ended ("finished", "preempted" or "failed"); returns at once."""
        if not self.ended:
            self.ended = True
            upload = str(checkpoint) if checkpoint is not None and self.upload_checkpoint else None
            for tracker in self.trackers:
                tracker.send((status, upload))

    def wait(self) -> bool:
        """Until every tracker has finished, within run.tracker_timeout_s for all of them together;
        whether none is still busy (one that is would hold the process's exit)."""
        self.end("failed")  # a no-op after the log's own end; else the run stopped before its log did
        if not all(tracker.done.is_set() for tracker in self.trackers):
            print(f"finishing the trackers (at most {self.timeout:g} s)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self.timeout
        return all([tracker.wait(deadline) for tracker in self.trackers])
