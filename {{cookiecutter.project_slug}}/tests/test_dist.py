"""The environment torchrun sets, backend by hardware, device binding, seeding; the store each
restart uses, CPUs under SLURM, preemption reporting, the shared run directory, downloads by
local rank 0 first."""

import signal
import sys

import pytest
import torch
from conftest import PROJECT, Writes, project_env, run, torchrun, train_args

from {{ cookiecutter.package_name }}.base import cpus, dist, preemption, rendezvous
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.tools import launch

TORCHRUN_ENV = {
    "RANK": "9",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "16",
    "LOCAL_WORLD_SIZE": "8",
    "TORCHELASTIC_RESTART_COUNT": "2",
}


def test_without_torchrun_the_run_is_a_world_of_one(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    info = DistInfo.from_env()
    assert (info.rank, info.world_size, info.backend, info.is_main, info.distributed) == (0, 1, "none", True, False)


def test_torchrun_environment_on_a_cpu_node(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = DistInfo.from_env()
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (9, 1, 16, 8)
    assert info.backend == "gloo" and info.device == torch.device("cpu")
    assert not info.is_main  # main process means global rank 0, not local rank 0


def test_gpu_nodes_use_nccl_and_the_local_rank_picks_the_device(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = DistInfo.from_env()
    assert info.backend == "nccl"  # never gloo on GPUs
    assert info.device == torch.device("cuda", 1)  # local rank, not global rank 9


def fake_init(monkeypatch, visible_gpus=2):
    calls = []
    monkeypatch.setattr(dist.torch_dist, "rendezvous", lambda *a, **k: iter([("store", 0, 2)]))
    monkeypatch.setattr(dist.torch_dist, "PrefixStore", lambda prefix, store: f"{prefix}{store}")
    monkeypatch.setattr(dist.torch_dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible_gpus)
    return calls


def test_init_binds_the_device_first_and_tells_the_process_group(monkeypatch):
    calls = fake_init(monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    info = DistInfo(1, 1, 2, 2, torch.device("cuda", 1), "nccl")
    dist.init(info, timeout_minutes=0.5)
    first, (second, options) = calls
    assert first == ("set_device", torch.device("cuda", 1)) and second == "init"  # before the first collective
    assert options["device_id"] == torch.device("cuda", 1)  # NCCL knows its GPU instead of guessing
    assert options["backend"] == "nccl" and options["timeout"].total_seconds() == 30
    assert options["store"] == "attempt3/store" and (options["rank"], options["world_size"]) == (1, 2)


def test_cpu_ranks_bind_nothing_and_pass_no_device(monkeypatch):
    calls = fake_init(monkeypatch, visible_gpus=0)
    dist.init(DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo"), timeout_minutes=1)
    ((name, options),) = calls
    assert name == "init" and options["device_id"] is None


@pytest.mark.parametrize(("agent_store", "prefix"), [("False", ""), ("True", "attempt2/"), (None, "attempt2/")])
def test_store_prefix_only_where_the_agents_store_outlives_restarts(agent_store, prefix):
    # torchrun sets TORCHELASTIC_USE_AGENT_STORE=False when every rendezvous round gets a fresh
    # store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the node launcher sets): no prefix, so
    # nodes whose restart counts differ (one rejoined, the other only saw it rejoin) still meet
    env = {"TORCHELASTIC_RESTART_COUNT": "2"} | (
        {} if agent_store is None else {"TORCHELASTIC_USE_AGENT_STORE": agent_store}
    )
    assert rendezvous.store_prefix(env) == prefix


def test_the_launcher_asks_torchrun_for_a_fresh_store_per_round():
    _, env = launch.prepare(["-m", "x"], {}, gpus=0, affinity=4)
    assert env.items() >= rendezvous.FRESH_STORE_ENV.items()
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.parametrize(
    ("local_rank", "local_world", "visible", "ok"),
    [(0, 1, 1, True), (3, 4, 4, True), (4, 8, 4, False), (0, 8, 4, False), (0, 2, 0, False)],
)
def test_a_rank_without_a_gpu_of_its_own_is_refused(monkeypatch, local_rank, local_world, visible, ok):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    info = DistInfo(local_rank, local_rank, local_world, local_world, torch.device("cuda", local_rank), "nccl")
    problem = dist.device_problem(info)
    assert (problem is None) == ok
    if not ok:
        assert f"{visible} GPU(s) visible" in problem and "NPROC_PER_NODE" in problem
        with pytest.raises(ConfigError, match="GPU"):
            dist.bind_device(info)


def test_cpu_ranks_need_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert dist.device_problem(DistInfo(3, 3, 8, 8, torch.device("cpu"), "gloo")) is None


def test_same_seed_gives_the_same_weights():
    dist.seed_everything(7)
    first = torch.nn.Linear(4, 4).weight.clone()
    torch.rand(10)  # whatever ran before, seeding resets it
    dist.seed_everything(7)
    assert torch.equal(first, torch.nn.Linear(4, 4).weight)


@pytest.mark.parametrize("affinity", [{0}, {0, 1, 2, 3}])
def test_cpus_follow_the_affinity_mask(monkeypatch, affinity):
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: affinity, raising=False)
    assert cpus.cpus_available() == len(affinity)


def test_cpus_are_capped_by_slurms_allocation_where_slurm_does_not_bind(monkeypatch):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "32")
    assert cpus.cpus_available() == 16


def test_preemption_is_reported_to_the_launcher_with_exit_0(monkeypatch, tmp_path):
    ignored = []
    monkeypatch.setattr(preemption.signal, "signal", lambda sig, handler: ignored.append((sig, handler)))
    marker = tmp_path / "preempted"
    monkeypatch.setenv(preemption.MARKER_ENV, str(marker))
    # exit 0: torchrun restarts workers that exit non-zero, and on several nodes the restarted
    # ones wait for a rendezvous the stopped nodes never join; the launcher exits 75 instead
    assert preemption.report_preemption() == 0 and marker.exists()
    monkeypatch.delenv(preemption.MARKER_ENV)
    assert preemption.report_preemption() == preemption.PREEMPTED_EXIT_CODE
    # from then on a late stop signal cannot kill the rank while Python drops its handlers at exit
    assert ignored[-1] == (preemption.WORKER_STOP_SIGNAL, signal.SIG_IGN)


def test_a_new_attempt_forgets_a_preemption_the_previous_one_reported(monkeypatch, tmp_path):
    # torchrun stops healthy workers with SIGTERM when another node rejoins; they may checkpoint and
    # report a preemption, but the restarted attempt finishing must end the launcher with 0
    marker = tmp_path / "preempted"
    marker.touch()
    monkeypatch.setenv(preemption.MARKER_ENV, str(marker))
    fake_init(monkeypatch, visible_gpus=0)
    dist.init(DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo"), timeout_minutes=1)
    assert not marker.exists()


def test_launcher_and_workers_agree_on_the_preemption_contract():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    flag = preemption.PreemptionFlag()  # the workers' handler covers the signal the launcher sends
    try:
        assert signal.getsignal(preemption.WORKER_STOP_SIGNAL) == flag._handle
        assert signal.getsignal(signal.SIGTERM) == previous[signal.SIGTERM]  # a failed peer's SIGTERM ends the rank
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_loader_workers_ignore_the_preemption_signal():
    previous = signal.getsignal(preemption.WORKER_STOP_SIGNAL)
    try:
        preemption.quiet_loader_worker(0)
        assert signal.getsignal(preemption.WORKER_STOP_SIGNAL) == signal.SIG_IGN
    finally:
        signal.signal(preemption.WORKER_STOP_SIGNAL, previous)


def test_shared_dir_check_is_free_on_one_node(tmp_path):
    info = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
    assert dist.shared_dir_problem(info, tmp_path) is None


SHARED_DIR_PROOF = """
import dataclasses
import sys
from pathlib import Path
from {{ cookiecutter.package_name }}.base import dist
from {{ cookiecutter.package_name }}.base.dist import DistInfo

info = DistInfo.from_env()
dist.init(info, timeout_minutes=1)
info = dataclasses.replace(info, local_world_size=1)  # as each rank sees it on two nodes of one process
base = Path(sys.argv[1])
shared = dist.shared_dir_problem(info, base / "shared")
# a node-local disk: the same path name, a different directory on each node
local = dist.shared_dir_problem(info, base / f"node{info.rank}")
dist.print0(info, f"shared={shared}")
dist.print0(info, f"local={local}")
dist.teardown(info)
"""


@pytest.mark.slow
def test_a_run_directory_not_shared_by_the_nodes_is_found_on_every_rank(tmp_path):
    proof = tmp_path / "proof.py"
    proof.write_text(SHARED_DIR_PROOF)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = run([*command, str(proof), str(tmp_path)], env=project_env(), timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "shared=None" in result.stdout
    assert "local=run.out_dir: ranks [1] cannot see" in result.stdout and "shared by all nodes" in result.stdout


def two_rank_node(monkeypatch, local_rank: int, gathered: list, calls: list) -> DistInfo:
    """Rank `local_rank` of a 2-rank node whose all-gather returns `gathered` and is logged in `calls`."""
    monkeypatch.setattr(dist, "all_gather_objects", lambda obj: calls.append(("gather", obj)) or gathered)
    return DistInfo(local_rank, local_rank, 2, 2, torch.device("cpu"), "gloo")


@pytest.mark.parametrize("local_rank, expected", [(0, ["build", ("gather", None)]), (1, [("gather", None), "build"])])
def test_local_rank_0_builds_before_the_others_which_wait_for_it(monkeypatch, local_rank, expected):
    calls = []
    info = two_rank_node(monkeypatch, local_rank, [None, None], calls)
    assert dist.local_main_first(info, lambda: calls.append("build") or "model") == "model"
    assert calls == expected


def test_a_config_error_in_local_rank_0s_build_is_raised_on_every_rank(monkeypatch):
    problem = ConfigError("dataset.root: /data/x is not a folder")

    def fails():
        raise problem

    calls = []
    with pytest.raises(ConfigError, match="is not a folder"):
        dist.local_main_first(two_rank_node(monkeypatch, 0, [problem, None], calls), fails)
    assert calls == [("gather", problem)]  # told the others before raising
    calls = []
    with pytest.raises(ConfigError, match="is not a folder"):
        dist.local_main_first(two_rank_node(monkeypatch, 1, [problem, None], calls), lambda: calls.append("build"))
    assert calls == [("gather", None)]  # never built


def test_another_error_in_local_rank_0s_build_stops_the_others_with_one_line_naming_it(monkeypatch):
    def fails():
        raise FileExistsError("[Errno 17] File exists: '/data/cache'")

    calls = []
    with pytest.raises(FileExistsError):  # its own exception, traceback and all, where it happened
        dist.local_main_first(two_rank_node(monkeypatch, 0, [None, None], calls), fails)
    assert calls == [("gather", "FileExistsError: [Errno 17] File exists: '/data/cache'")]
    summary = "FileExistsError: [Errno 17] File exists: '/data/cache'"
    with pytest.raises(RuntimeError, match=r"local rank 0 could not build the model and datasets: FileExistsError"):
        dist.local_main_first(two_rank_node(monkeypatch, 1, [summary, None], []), pytest.fail)


def test_a_failure_report_is_one_write_so_the_ranks_lines_never_run_together(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    dist.report_failure(DistInfo(1, 1, 2, 2, torch.device("cpu"), "gloo"), ValueError("bad sample 12"))
    noted = RuntimeError("DDP's words")
    noted.add_note("set parallel.find_unused_parameters=true")  # the fix, as the loop adds it
    dist.report_failure(DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo"), noted)
    assert stderr.calls == [
        "[rank 1/2] ValueError: bad sample 12\n",
        "[rank 0/2] RuntimeError: DDP's words\n  set parallel.find_unused_parameters=true\n",
    ]


def test_a_world_of_one_builds_without_a_collective(monkeypatch):
    monkeypatch.setattr(dist, "all_gather_objects", lambda obj: pytest.fail("no collective in a world of one"))
    assert dist.local_main_first(DistInfo(0, 0, 1, 1, torch.device("cpu"), "none"), lambda: 7) == 7


@pytest.mark.slow
def test_a_download_in_the_model_build_happens_once_a_node(tmp_path):
    """The seam downloads weights unless they are cached, on 2 ranks of one node: only local rank 0 fetches."""
    cache = tmp_path / "cache"
    env = project_env(FAULT="fetch", FAULT_CACHE=str(cache), FAULT_SECONDS="1")
    torchrun(str(PROJECT / "tests" / "faulty_train.py"), *train_args(tmp_path, "train.max_steps=2")[2:], env=env)
    assert (cache / "fetched").read_text().split() == ["0"]
