"""W&B and MLflow (run.trackers): one tracked run per training run, on global rank 0 only, and
never a reason for training to stop.

The fast tests check the settings, the tracked-run id and the records each tracker is sent. The
slow ones train on 2 ranks against real stores, all offline: MLflow on a SQLite file, W&B in
offline mode; and hang a real store (a locked SQLite file, W&B's stopped service process). W&B
has no reader for its offline files, so `wandb_history` reads them itself:
the file is a sequence of W&B's protobuf `Record`s in LevelDB's log framing (7-byte header,
32 KiB blocks); the test checks the run record's id and config, and every history row's step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import sqlite3
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    PROJECT,
    SMOKE_CONFIG,
    descendants,
    finish,
    newest_checkpoint,
    project_env,
    read_metrics,
    wait_for,
)

from {{ cookiecutter.package_name }} import config
from {{ cookiecutter.package_name }}.base import preemption, records
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint, tracking

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed: pip install -e '.[mlflow]'"
)
needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed: pip install -e '.[wandb]'"
)


def test_unknown_or_missing_trackers_are_config_errors_that_name_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match=r"run.trackers: \['neptune'\] is invalid; name wandb, mlflow once each"):
        config.load(SMOKE_CONFIG, ["run.trackers=[neptune]"])
    with pytest.raises(ConfigError, match="is invalid"):
        config.load(SMOKE_CONFIG, ["run.trackers=[mlflow, mlflow]"])
    with pytest.raises(ConfigError, match="TensorBoard is not a tracker here but run.tensorboard"):
        config.load(SMOKE_CONFIG, ["run.trackers=[tensorboard]"])  # the prompt's word for it
    monkeypatch.setattr(tracking.extras, "installed", lambda name: False)
    with pytest.raises(ConfigError, match=r"needs wandb, which is not installed: pip install -e '.\[wandb\]'"):
        tracking.check(["wandb"])
    tracking.check([])  # no trackers: nothing to find


def test_the_tracked_run_id_is_kept_in_the_run_and_a_new_run_name_gets_its_own(tmp_path):
    run_dir, other = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    own = run_dir.checkpoint(10)
    first = tracking.tracked_run_id(run_dir, None, None)  # the first start
    assert json.loads((tmp_path / "a" / "tracking" / "run.json").read_text()) == {"id": first}
    assert tracking.tracked_run_id(run_dir, own, first) == first  # a resume continues the checkpoint's
    assert tracking.tracked_run_id(run_dir, own, None) == first  # a checkpoint from before a tracker was named
    assert tracking.tracked_run_id(other, own, first) != first  # another run's checkpoint: a new tracked run
    assert tracking.tracked_run_id(run_dir, None, None) != first  # a fresh start (checkpoint.resume=never) too


def test_only_global_rank_0_starts_trackers(tmp_path):
    cfg = config.load(SMOKE_CONFIG, [f"run.out_dir={tmp_path}", "run.trackers=[wandb, mlflow]"])
    rank_1, trackers = DistInfo(1, 0, 2, 1, torch.device("cpu"), "gloo"), tracking.Trackers()
    assert trackers.start(cfg, rank_1, None, SimpleNamespace(tracked_run_id="kept", step=0)) == "kept"
    assert trackers.trackers == [] and not (tmp_path / "smoke" / "tracking").exists()


def test_a_resumed_start_sends_each_tracker_the_timelines_records_it_never_took(tmp_path):
    run_dir = RunDir(tmp_path / "a")
    lines = [{"kind": "train", "step": s, "start_step": 0, "elapsed_s": s, "loss": 1.0} for s in (5, 10, 15, 20)]
    lines.append({"kind": "eval", "step": 20, "eval_loss": 1.0})
    lines += [{"kind": "train", "step": s, "start_step": 10, "elapsed_s": s, "loss": 0.5} for s in (15, 20, 25)]
    run_dir.root.mkdir()
    run_dir.metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    sent = tracking.timeline_up_to(run_dir, 20)  # the attempt that resumed at 10 went to 25
    assert [(r["step"], r["loss"]) for r in sent] == [(5, 1.0), (10, 1.0), (15, 0.5), (20, 0.5)]  # its train records
    assert tracking.timeline_up_to(run_dir, 0) == []  # a fresh start: none
    run_dir.tracking.mkdir()
    (run_dir.tracking / "mlflow-x.json").write_text(json.dumps({"train": 5}))  # what it took before
    start = {"run_dir": str(run_dir.root), "id": "x", "timeout": 5, "params": {}}
    tracker, service = tracking.Tracker("mlflow", start, Recording), Recording({})
    tracker.log(service, sent)
    assert service.sent == [("metrics", [10, 15, 20])]  # not step 5, which it took before


def test_settings_become_flat_params():
    params = tracking.flat({"config": {"optim": {"lr": 0.001}, "train": {"compile": False}, "run": {"name": "a"}}})
    assert params == {"config.optim.lr": "0.001", "config.train.compile": "false", "config.run.name": "a"}


def test_the_tracked_params_name_the_code_commit_and_say_when_files_differ_from_it(tmp_path):
    assert tracking.git_commit(tmp_path) is None  # outside git
    git = ["git", "-C", str(tmp_path), "-c", "user.name=a", "-c", "user.email=a@b"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "model.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert tracking.git_commit(tmp_path) == head
    (tmp_path / "model.py").write_text("x = 2\n")  # an edit not yet committed
    assert tracking.git_commit(tmp_path) == f"{head}-dirty"


def test_the_names_the_settings_accept_are_the_trackers_there_are():
    assert set(config.TRACKERS) == set(tracking.SERVICES)


class Recording:
    """A tracker service that keeps what it is sent, in order."""

    note = "recording"

    def __init__(self, start: dict):
        self.sent = []

    def metrics(self, rows):
        self.sent += [("metrics", [step for step, _ in rows])] if rows else []

    def summary(self, values, step):
        self.sent.append(("summary", step))

    def finish(self, status, checkpoint):
        self.sent.append(("finish", status))


def test_a_batch_of_records_goes_out_in_order_in_one_call_without_the_steps_already_taken(tmp_path):
    start = {"run_dir": str(tmp_path), "id": "x", "timeout": 5, "params": {}}
    tracker, service = tracking.Tracker("recording", start, Recording), Recording({})
    tracker.log(service, [{"kind": "train", "step": 5, "loss": 1.0}])
    replayed_and_new = [{"kind": "train", "step": step, "loss": 1.0} for step in (5, 10, 15)]
    end = [{"kind": "eval", "step": 15, "eval_loss": 1.0}, {"kind": "summary", "step": 15, "summary": {"steps": 15}}]
    tracker.log(service, replayed_and_new + end)
    assert service.sent == [("metrics", [5]), ("metrics", [10, 15, 15]), ("summary", 15)]
    assert json.loads((tmp_path / "tracking" / "recording-x.json").read_text()) == {"train": 15, "eval": 15}


def test_a_tracker_is_sent_every_record_and_the_run_end_on_a_thread_of_its_own(tmp_path, capsys):
    started = []

    def service(start):
        started.append(Recording(start))
        return started[-1]

    tracker = tracking.Tracker("recording", {"run_dir": str(tmp_path), "id": "x", "timeout": 5, "params": {}}, service)
    for step in (5, 10):
        tracker.send({"kind": "train", "step": step, "loss": 1.0})
    tracker.send(("finished", None))
    assert tracker.wait(deadline=time.monotonic() + 10) and not tracker.dropped
    (recording,) = started
    assert [step for kind, steps in recording.sent if kind == "metrics" for step in steps] == [5, 10]
    assert recording.sent[-1] == ("finish", "finished")
    assert "tracker recording: recording" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(tmp_path: Path, *overrides: str, nproc: int = 2, **env: str) -> subprocess.Popen:
    """scripts/train.sh on `nproc` CPU ranks with the tracker environment `env`, in a session of its own."""
    arguments = ["--config", SMOKE_CONFIG, f"run.out_dir={tmp_path}", "run.log_every=5", "data.num_workers=0"]
    return subprocess.Popen(
        ["bash", str(PROJECT / "scripts" / "train.sh"), *arguments, *overrides],
        cwd=tmp_path,  # MLflow's and W&B's defaults write beside the launch, not into the project
        env=project_env(NPROC_PER_NODE=str(nproc), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stopped_and_resumed(tmp_path: Path, trackers: list[str], when_stopped, **env: str) -> tuple[int, int]:
    """Train, stop with SIGTERM once every tracker took a few records (exit 75), call
    `when_stopped()`, then continue from a checkpoint older than the stop's, so the steps in
    between are replayed, to the end, uploading the final checkpoint. Returns (the stop's step,
    the last step)."""
    named = f"run.trackers=[{', '.join(trackers)}]"
    job = launch(tmp_path, "train.epochs=200", "checkpoint.every_steps=10", named, **env)
    try:
        wait_for(lambda: all(taken_by(tmp_path, name) >= 20 for name in trackers), 90)
        job.send_signal(signal.SIGTERM)
        ((code, stdout, stderr),) = finish([job], timeout=90)
    finally:
        job.kill()
    assert code == preemption.PREEMPTED_EXIT_CODE, stderr[-3000:]
    when_stopped()
    stop = int(newest_checkpoint(tmp_path / "smoke").name.removeprefix("step_").removesuffix(".pt"))
    older = tmp_path / "smoke" / "checkpoints" / f"step_{(stop - 1) // 10 * 10:08d}.pt"
    last = stop + 15
    resumed = [f"train.max_steps={last}", f"checkpoint.resume={older}", "run.tracker_checkpoint=true", named]
    rerun = launch(tmp_path, "train.epochs=200", *resumed, **env)
    ((code, stdout, stderr),) = finish([rerun], timeout=120)
    assert code == 0 and f"done: {last} steps" in stdout, stderr[-3000:]
    assert "warning:" not in stderr, stderr
    return stop, last


def taken_by(out_dir: Path, tracker: str) -> int:
    """The last train step `tracker` took in the run "smoke" under `out_dir`, or -1."""
    try:
        (path,) = (out_dir / "smoke" / "tracking").glob(f"{tracker}-*.json")
        return json.loads(path.read_text()).get("train", -1)
    except (OSError, ValueError):
        return -1


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of the train records in metrics.jsonl, each once (a replay logs some twice)."""
    return sorted({r["step"] for r in records.of_kind(read_metrics(run_dir), records.TRAIN)})


def wandb_records(path: Path):
    """The protobuf records of one W&B offline file (see the module docstring)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, block = path.read_bytes(), 7, b"", 32768
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_items(items) -> dict:
    """W&B's key/value items; a key holding "/" is kept as its parts."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


@dataclass
class WandbFragment:
    """What one start of a run wrote in W&B's offline mode."""

    run_id: str = ""
    settings: dict = field(default_factory=dict)  # the run's config
    steps: list[int] = field(default_factory=list)  # of the history rows carrying train/loss
    exit_code: int | None = None
    artifacts: int = 0


def wandb_history(run_dir: Path) -> list[WandbFragment]:
    """Each offline run directory's fragment, oldest first."""
    found = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        fragment = WandbFragment()
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                fragment.run_id = record.run.run_id
                fragment.settings |= wandb_items(record.run.config.update)
            elif kind == "config":
                fragment.settings |= wandb_items(record.config.update)
            elif kind == "history":
                row = wandb_items(record.history.item)
                fragment.steps += [row["step"]] if "train/loss" in row else []
            elif kind == "exit":
                fragment.exit_code = record.exit.exit_code
            elif kind == "artifact":
                fragment.artifacts += 1
        found.append(fragment)
    return found


@needs_mlflow
@needs_wandb
@pytest.mark.slow
def test_a_stopped_and_resumed_run_is_one_tracked_run_in_mlflow_and_wandb_with_each_step_once(tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    environment = {"MLFLOW_TRACKING_URI": store, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    client = MlflowClient(store)

    def preempted_in_mlflow():
        (run,) = client.search_runs([client.get_experiment_by_name(tracking.PROJECT).experiment_id])
        assert run.info.status == "KILLED"

    stop, last = stopped_and_resumed(tmp_path, ["mlflow", "wandb"], preempted_in_mlflow, **environment)
    every_step = list(range(5, last + 1, 5))
    assert stop < last and logged_steps(tmp_path / "smoke") == every_step
    tracked = json.loads((tmp_path / "smoke" / "tracking" / "run.json").read_text())["id"]
    saved = checkpoint.load_file(tmp_path / "smoke" / "checkpoints" / f"step_{last:08d}.pt")
    assert saved["tracked_run_id"] == tracked

    (run,) = client.search_runs([client.get_experiment_by_name(tracking.PROJECT).experiment_id])
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")] == every_step
    assert run.info.status == "FINISHED" and run.info.run_name == "smoke" and run.data.tags["tracked_run_id"] == tracked
    params = run.data.params
    assert params["config.run.trackers"] == '["mlflow", "wandb"]'
    assert params["config.optim.lr"] == json.dumps(saved["config"]["optim"]["lr"])
    assert params["world_size"] == "2" and params["torch"] == torch.__version__
    assert params["config.train.max_steps"] == "null"  # the first start's value is kept, the change is a tag
    assert any(tag.startswith("changed_on_resume") for tag in run.data.tags)
    uploaded = [item.path for item in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert uploaded == [f"checkpoints/step_{last:08d}.pt"]

    fragments = wandb_history(tmp_path / "smoke")  # offline: one directory per start, `wandb sync` both
    assert [fragment.run_id for fragment in fragments] == [tracked, tracked]
    assert [step for fragment in fragments for step in fragment.steps] == every_step
    settings = fragments[0].settings
    assert settings["config"]["run"]["trackers"] == ["mlflow", "wandb"] and settings["world_size"] == 2
    assert [fragment.exit_code for fragment in fragments] == [preemption.PREEMPTED_EXIT_CODE, 0]  # preempted, finished
    assert [fragment.artifacts for fragment in fragments] == [0, 1]  # the final checkpoint


@needs_mlflow
@needs_wandb
@pytest.mark.slow
def test_failing_trackers_warn_once_each_and_training_finishes_with_exit_0(tmp_path):
    job = launch(
        tmp_path,
        "run.trackers=[wandb, mlflow]",
        "run.tracker_timeout_s=15",  # MLflow's own error comes within 3 s here; room for a loaded machine
        "train.max_steps=40",
        MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}",  # nothing listens: MLflow's retries, bounded, fail
        WANDB_MODE="online",  # without an API key: wandb.init raises
        WANDB_API_KEY="",
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        HOME=str(tmp_path),  # no ~/.netrc login
    )
    ((code, stdout, stderr),) = finish([job], timeout=120)
    assert code == 0 and "done: 40 steps" in stdout, stderr[-3000:]
    warnings = sorted(line for line in stderr.splitlines() if line.startswith("warning: tracker"))
    assert len(warnings) == 2, stderr
    # MLflow's own error, from within the limit (the worker bounds its retries; a tracker that never
    # answers is dropped at run.tracker_timeout_s: test_a_tracker_that_hangs_mid_run_...)
    assert warnings[0].startswith("warning: tracker mlflow dropped: MlflowException: API request to http://127.0.0.1")
    assert "Connection refused" in warnings[0]
    assert warnings[1].startswith("warning: tracker wandb dropped: UsageError:")
    saved = read_metrics(tmp_path / "smoke")
    assert [r["step"] for r in records.of_kind(saved, records.TRAIN)] == list(range(5, 41, 5))
    assert records.of_kind(saved, records.SUMMARY)
    assert (tmp_path / "smoke" / "checkpoints" / "step_00000040.pt").exists()


@needs_mlflow
@pytest.mark.slow
def test_a_tracker_whose_store_hangs_mid_run_is_dropped_and_never_waited_on(tmp_path, capsys, monkeypatch):
    """MLflow takes its start and a first record, then another connection holds its SQLite file's
    write lock, as a stalled server or a lock on NFS would hold it: the next call outlasts the limit."""
    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    start = {"id": "hang", "name": "smoke", "project": "hangs", "run_dir": str(tmp_path), "timeout": 60, "params": {}}
    tracker = tracking.Tracker("mlflow", start)
    tracker.send({"kind": "train", "step": 5, "loss": 1.0})
    # started, and its first record's call answered
    wait_for(lambda: (tracker.taken.get("train") == 5 and tracker.busy is None) or tracker.dropped, timeout=60)
    assert not tracker.dropped
    lock = sqlite3.connect(store, timeout=0)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        tracker.timeout = 1.0
        tracker.send({"kind": "train", "step": 10, "loss": 0.5})
        began = time.monotonic()
        tracker.send(("finished", None))
        idle = tracker.wait(deadline=time.monotonic() + 30)
        waited = time.monotonic() - began
    finally:
        lock.rollback()
        lock.close()
    assert not idle and waited < 2.5  # dropped at the limit, its call left behind
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: tracker mlflow dropped: no answer to the train record of step 10 within run.tracker_timeout_s=1 s"
    )


@needs_wandb
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds W&B's service process in /proc")
def test_a_tracker_that_hangs_at_the_end_is_left_behind_and_the_run_exits_0_on_time(tmp_path):
    """W&B's own service process stops mid-run (SIGSTOP), as a hung upload would hold it: rank 0 waits
    run.tracker_timeout_s for the run's end after training, out of the process group (rank 1 never
    waits for it), then exits 0 without W&B's exit handlers, which would wait for the service forever."""
    environment = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # 20 s: W&B's start (its service process) must fit in the limit on a loaded machine, where 5 s
    # dropped the tracker before it took a step and the drill never reached its hang; 200 steps: W&B
    # takes its first 10 well before training ends, so its service is stopped mid-run
    limits = ("run.tracker_timeout_s=20", "train.epochs=4", "train.max_steps=200")
    # rank 0 waits for the stopped service after leaving the process group: were it to wait inside it,
    # rank 1 would time out at its next collective before rank 0's 20 s were up (15 s: well above a
    # loaded machine's skew between the ranks, where 3 s failed a run in CI)
    limits += ("dist.timeout_minutes=0.25",)
    job = launch(tmp_path, "run.trackers=[wandb]", *limits, **environment)
    try:
        wait_for(lambda: taken_by(tmp_path, "wandb") >= 10 or job.poll() is not None, 90)
        if job.poll() is not None:  # the run ended before W&B took 10 steps: say why
            ((code, stdout, stderr),) = finish([job], timeout=30)
            pytest.fail(f"the run ended (exit {code}) before W&B took 10 steps: {stderr[-3000:]}")
        services = [pid for pid in descendants(job.pid) if b"wandb-core" in command_line(pid)]
        assert services, f"no W&B service process found among {[command_line(pid) for pid in descendants(job.pid)]}"
        for pid in services:
            os.kill(pid, signal.SIGSTOP)
        began = time.monotonic()
        wait_for(lambda: job.poll() is not None, 120)
        ended = time.monotonic() - began
        for pid in services:  # a stopped service cannot see that rank 0 is gone, and holds the job's pipes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ((code, stdout, stderr),) = finish([job], timeout=30)
    finally:
        job.kill()
    assert code == 0 and "done: 200 steps" in stdout, stderr[-3000:]
    assert ended < 100  # the rest of training, then at most run.tracker_timeout_s
    warnings = [line for line in stderr.splitlines() if line.startswith("warning: tracker")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: tracker wandb dropped: no answer to"), stderr


def command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return b""


@needs_mlflow
@needs_wandb
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="the loopback nodes' drill reads /proc")
def test_on_two_nodes_only_global_rank_0_creates_a_tracked_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from test_multinode import start_nodes

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name, value in {"MLFLOW_TRACKING_URI": store, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)  # the nodes inherit the test's environment
    nodes = start_nodes(tmp_path, "train.max_steps=20", "run.trackers=[wandb, mlflow]", "run.log_every=5")
    results = finish(nodes, timeout=120)
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    client = MlflowClient(store)
    experiments = client.search_experiments()
    runs = client.search_runs([experiment.experiment_id for experiment in experiments])
    assert len(runs) == 1 and len(list((tmp_path / "smoke" / "wandb").glob("offline-run-*"))) == 1
