"""P1-P5: the environment torchrun sets, backend by hardware, device binding, seeding."""

import pytest
import torch

from {{ cookiecutter.package_name }} import dist
from {{ cookiecutter.package_name }}.dist import DistInfo

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
    assert info.backend == "gloo" and info.device == torch.device("cpu") and info.restart == 2
    assert not info.is_main  # main process means global rank 0, not local rank 0


def test_gpu_nodes_use_nccl_and_the_local_rank_picks_the_device(monkeypatch):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info = DistInfo.from_env()
    assert info.backend == "nccl"  # never gloo on GPUs (P2)
    assert info.device == torch.device("cuda", 1)  # local rank, not global rank 9 (P3)


def test_init_binds_the_device_right_after_joining(monkeypatch):
    calls = []
    monkeypatch.setattr(dist.torch_dist, "rendezvous", lambda *a, **k: iter([(object(), 0, 2)]))
    monkeypatch.setattr(dist.torch_dist, "PrefixStore", lambda prefix, store: prefix)
    monkeypatch.setattr(dist.torch_dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    info = DistInfo(1, 1, 2, 2, torch.device("cuda", 1), "nccl", restart=3)
    dist.init(info, timeout_minutes=0.5)
    (first, options), second = calls
    assert first == "init" and second == ("set_device", torch.device("cuda", 1))
    assert options["backend"] == "nccl" and options["timeout"].total_seconds() == 30  # P4
    assert options["store"] == "attempt3/" and (options["rank"], options["world_size"]) == (1, 2)


def test_same_seed_gives_the_same_weights():
    dist.seed_everything(7)
    first = torch.nn.Linear(4, 4).weight.clone()
    torch.rand(10)  # whatever ran before, seeding resets it
    dist.seed_everything(7)
    assert torch.equal(first, torch.nn.Linear(4, 4).weight)


@pytest.mark.parametrize("affinity", [{0}, {0, 1, 2, 3}])
def test_cpus_follow_the_affinity_mask(monkeypatch, affinity):
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: affinity, raising=False)
    assert dist.cpus_available() == len(affinity)
