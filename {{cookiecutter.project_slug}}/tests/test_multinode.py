"""Two "nodes" on loopback: two scripts/train_multinode.sh processes, one CPU rank each, c10d
rendezvous. A worker killed on one node must make both nodes re-form and resume (each node's
torchrun counts restarts on its own, and a node that only saw the other rejoin counts none);
a stop on one node must checkpoint every node and end both, not leave one restarting; with an
elastic range (NNODES=1:2) a node lost for good leaves the other to go on alone."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    PROJECT,
    SMOKE_CONFIG,
    finish,
    kill_session,
    newest_checkpoint,
    project_env,
    train_losses,
    wait_for,
)

from {{ cookiecutter.package_name }}.base import preemption
from {{ cookiecutter.package_name }}.loop import checkpoint, elastic
from {{ cookiecutter.package_name }}.tools import launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds a node's worker in /proc"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_nodes(
    tmp_path: Path, *overrides: str, max_restarts: int = 0, nnodes: str = "2", rdzv_conf: str = ""
) -> list[subprocess.Popen]:
    """Two nodes; the first hosts the rendezvous (both match its loopback address, and the first
    to listen on the port hosts it), so the second is the one a test may lose for good."""
    port = free_port()
    env = project_env(
        NNODES=nnodes,
        NPROC_PER_NODE="1",
        CUDA_VISIBLE_DEVICES="",
        GLOO_SOCKET_IFNAME="lo",
        RDZV_ENDPOINT=f"127.0.0.1:{port}",
        RDZV_ID="loopback",
        MAX_RESTARTS=str(max_restarts),
        RDZV_CONF=rdzv_conf,
    )
    command = ["bash", "scripts/train_multinode.sh", "--config", SMOKE_CONFIG, f"run.out_dir={tmp_path}"]
    command.append("data.num_workers=0")  # fewer processes to start on each (re)start: the test stays short
    nodes = []
    for _ in range(2):
        nodes.append(
            subprocess.Popen(
                [*command, *overrides],
                cwd=PROJECT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
        if len(nodes) == 1:
            wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, timeout=30)
    return nodes


def worker_of(node: subprocess.Popen) -> int:
    """The rank process on a node: the script execs the launcher, whose child is torchrun."""
    (torchrun,) = launch.children(node.pid)
    (worker,) = launch.children(torchrun)
    return worker


def test_a_killed_worker_makes_both_nodes_re_form_and_resume(tmp_path):
    start = time.monotonic()
    nodes = start_nodes(tmp_path, "train.max_steps=20", "checkpoint.every_steps=5", max_restarts=2)
    try:
        wait_for(lambda: newest_checkpoint(tmp_path / "smoke") is not None, timeout=40)
        os.kill(worker_of(nodes[1]), signal.SIGKILL)
    finally:
        results = finish(nodes, timeout=45)
    assert [code for code, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    out = "".join(stdout for _, stdout, _ in results)
    assert "resumed from" in out and "done: 20 steps" in out  # re-formed, resumed, finished
    final = checkpoint.load_file(tmp_path / "smoke" / "checkpoints" / "step_00000020.pt")
    assert final["step"] == 20 and final["world_size"] == 2
    assert time.monotonic() - start < 60


def test_a_stop_on_one_node_checkpoints_every_node_and_ends_both(tmp_path):
    nodes = start_nodes(tmp_path, "train.epochs=200", "checkpoint.every_steps=100000", max_restarts=3)
    metrics = tmp_path / "smoke" / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=40)
        stopped = time.monotonic()
        os.kill(nodes[1].pid, signal.SIGTERM)  # one node only: its own scheduler, or a Ctrl-C there
    finally:
        results = finish(nodes, timeout=45)
    codes = [code for code, _, _ in results]
    assert codes == [preemption.PREEMPTED_EXIT_CODE] * 2, "\n".join(err[-3000:] for _, _, err in results)
    assert time.monotonic() - stopped < 30  # the other node did not restart into a lost rendezvous
    saved = newest_checkpoint(tmp_path / "smoke").name
    step = int(saved.removeprefix("step_").removesuffix(".pt"))
    assert any(f"preempted at step {step}: checkpoint written" in stdout for _, stdout, _ in results)
    assert len(train_losses(tmp_path / "smoke")) >= 1


def wait_for_checkpoint(run_dir: Path, world_size: int, after_step: int, timeout: float) -> dict:
    """The newest checkpoint's contents, once `world_size` ranks wrote one past `after_step`."""
    deadline = time.monotonic() + timeout
    while True:
        path = newest_checkpoint(run_dir)
        try:
            payload = checkpoint.load_file(path) if path else None
        except OSError:  # set aside (checkpoint.keep_last) as it was read
            payload = None
        if payload and payload["world_size"] == world_size and payload["step"] > after_step:
            return payload
        assert time.monotonic() < deadline, f"no checkpoint of {world_size} ranks past step {after_step} in {timeout} s"
        time.sleep(0.1)


def test_an_elastic_run_that_loses_a_node_goes_on_with_the_other_and_keeps_the_global_batch(tmp_path):
    # A run longer than the test, ended by a stop, and lost while both nodes train: a run that ended
    # first left the survivor waiting at torchrun's exit barrier for the lost node. The rendezvous
    # waits 20 s (last_call_timeout) for a second node: in the first round, for the second node to
    # start (2 s was too short on a loaded host: the first node trained alone), and in the round
    # after the loss, for a node that may come back.
    run_dir = tmp_path / "smoke"
    nodes = start_nodes(
        tmp_path,
        "train.epochs=1000",
        "checkpoint.every_steps=10",
        max_restarts=2,
        nnodes="1:2",
        rdzv_conf="last_call_timeout=20",
    )
    try:
        both = wait_for_checkpoint(run_dir, world_size=2, after_step=0, timeout=60)
        kill_session(nodes[1], signal.SIGKILL)  # its launcher, torchrun and rank: the machine is gone
        alone = wait_for_checkpoint(run_dir, world_size=1, after_step=both["step"], timeout=120)
        os.kill(nodes[0].pid, signal.SIGTERM)  # the survivor trained on alone: stop it
    finally:
        results = finish(nodes, timeout=60)
    code, stdout, stderr = results[0]
    assert code == preemption.PREEMPTED_EXIT_CODE, stderr[-5000:]
    kept = elastic.saved_global_batch(both)  # 32 = 16 a rank x 2 ranks, when both nodes joined at once
    resumed = rf"resumed on 1 rank from a 2-rank checkpoint: batch \d+ x 1 x accum \d+ keeps the global batch {kept}\n"
    assert re.search(resumed, stdout), stdout[-3000:]
    assert "settings changed" not in stdout  # the new split is the run's doing, not a change of the user's
    assert elastic.saved_global_batch(alone) == kept
