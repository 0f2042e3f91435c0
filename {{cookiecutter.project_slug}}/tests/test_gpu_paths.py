"""The GPU paths on real GPUs (`pytest -m gpu`): the GPU-count guard, the bf16 rule on the
rank's own GPU without touching GPU 0, where ranks really compute (the smoke check's device
row), the device bound before the process group is created, and parallel.strategy=fsdp on nccl
(the proofs, bf16 gathering, CPU offload). Skipped, with the reason,
where the GPUs are missing; the same logic with CUDA faked is in test_hardware.py."""

import sys

import pytest
import torch
from conftest import PACKAGE, PROJECT, needs_cuda, needs_gpus, project_env, run, torchrun, train_args

from {{ cookiecutter.package_name }}.base import dist, hardware
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.tools import launch
from {{ cookiecutter.package_name }}.tools.launch import LaunchError


@needs_cuda
def test_the_launcher_counts_the_gpus_cuda_shows_and_refuses_more_processes():
    count = torch.cuda.device_count()
    assert hardware.visible_gpus() == count
    assert launch.processes_per_node(None, count, count)[0] == count
    with pytest.raises(LaunchError):
        launch.processes_per_node(str(count + 1), count, count)
    command = [sys.executable, "-m", f"{PACKAGE}.tools.launch", "--standalone", "-m", f"{PACKAGE}.train"]
    result = run(command, env=project_env(NPROC_PER_NODE=str(count + 1)), timeout=60, check=False)
    assert result.returncode == 2 and f"NPROC_PER_NODE<={count}" in result.stderr


@needs_cuda
def test_a_rank_beyond_the_gpus_is_refused_before_binding():
    count = torch.cuda.device_count()
    info = DistInfo(count, count, count + 1, count + 1, torch.device("cuda", count), "nccl")
    assert f"{count} GPU(s) visible" in dist.device_problem(info)
    with pytest.raises(ConfigError):
        dist.bind_device(info)


@needs_cuda
def test_the_bf16_rule_matches_the_device():
    capability = torch.cuda.get_device_capability(0)
    native = hardware.precision_problem("bf16", torch.device("cuda", 0)) is None
    assert native == (capability >= (8, 0)) == hardware.bf16_native(capability)
    if "including_emulation" in torch.cuda.is_bf16_supported.__code__.co_varnames:
        assert native == torch.cuda.is_bf16_supported(including_emulation=False)


NO_CONTEXT_ON_GPU_0 = """
import ctypes
import torch
from {{ cookiecutter.package_name }}.base import dist
from {{ cookiecutter.package_name }}.base import hardware
from {{ cookiecutter.package_name }}.base.dist import DistInfo

info = DistInfo.from_env()
problem = dist.device_problem(info)
dist.bind_device(info)
hardware.precision_problem("bf16", info.device)
torch.ones(1, device=info.device)
cuda = ctypes.CDLL("libcuda.so.1")


def active(ordinal):
    device, flags, state = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(device), ordinal)
    cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state))
    return state.value


print(f"problem={problem} current={torch.cuda.current_device()} gpu0={active(0)} gpu1={active(1)}")
"""


@needs_gpus(2)
def test_checking_and_binding_rank_1_opens_no_context_on_gpu_0(tmp_path):
    script = tmp_path / "rank1.py"
    script.write_text(NO_CONTEXT_ON_GPU_0)
    env = project_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    result = run([sys.executable, str(script)], env=env, timeout=120)
    assert "problem=None current=1 gpu0=0 gpu1=1" in result.stdout


BOUND_BEFORE_INIT = """
import torch
import torch.distributed as torch_dist
from {{ cookiecutter.package_name }}.base import dist
from {{ cookiecutter.package_name }}.base import hardware
from {{ cookiecutter.package_name }}.base.dist import DistInfo

info = DistInfo.from_env()
dist.init(info, timeout_minutes=2)
group = torch_dist.distributed_c10d._get_default_group()
ok = torch.cuda.current_device() == info.local_rank and group.bound_device_id == info.device
total = torch.ones(1, device=info.device)
dist.all_reduce_sum(total)
good = dist.all_gather_objects(hardware.device_identity(info.device))
problems_good = hardware.device_problems(good)
torch.cuda.set_device(0)  # every rank on GPU 0: what forgetting set_device(local_rank) does
bad = dist.all_gather_objects(hardware.device_identity(torch.device("cuda", info.local_rank)))
problems_bad = hardware.device_problems(bad)
dist.print0(info, f"bound={ok} sum={int(total.item())} good={problems_good}")
dist.print0(info, f"bad={problems_bad}")
dist.teardown(info)
"""


@needs_gpus(2)
def test_the_device_is_bound_before_the_group_and_the_smoke_row_sees_what_cuda_reports(tmp_path):
    script = tmp_path / "bound.py"
    script.write_text(BOUND_BEFORE_INIT)
    result = torchrun(str(script), nproc=2, timeout=180)
    assert "bound=True sum=2 good=[]" in result.stdout
    assert "rank 1 computes on cuda:0, not cuda:1" in result.stdout and "share GPU" in result.stdout


@needs_gpus(2)
@pytest.mark.fsdp
def test_fsdp_proofs_hold_on_two_gpus_with_nccl(tmp_path):
    proofs = str(PROJECT / "tests" / "dist_proofs.py")
    result = torchrun(proofs, str(tmp_path), "--only", "fsdp", nproc=2, timeout=300, check=False)
    assert "fsdp proofs on 2 ranks: PASS" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


@needs_gpus(2)
@pytest.mark.fsdp
@pytest.mark.parametrize("offload", ["false", "true"])
def test_fsdp_trains_in_bf16_on_two_gpus_with_and_without_cpu_offload(tmp_path, offload):
    # bf16 gathering with fp32 gradient reduction; offload: the state in CPU memory, gloo beside nccl
    overrides = ("parallel.strategy=fsdp", "train.precision=bf16", f"parallel.cpu_offload={offload}")
    result = torchrun(*train_args(tmp_path, *overrides), timeout=300)
    assert "strategy fsdp on 2 ranks" in result.stdout and "done:" in result.stdout
