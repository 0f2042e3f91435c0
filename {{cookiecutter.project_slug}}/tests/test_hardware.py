"""GPU facts with CUDA faked: the bf16 rule, where ranks really compute, the doctor's GPU rows,
the compile + SyncBatchNorm note. The same paths on real GPUs: test_gpu_paths.py."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }} import train
from {{ cookiecutter.package_name }}.base import hardware
from {{ cookiecutter.package_name }}.base.hardware import Gpu
from {{ cookiecutter.package_name }}.tools import checks, diagnose


@pytest.mark.parametrize(
    ("capability", "native"),
    [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True), ((6, 1), False)],
)
def test_bf16_is_native_from_ampere_on(capability, native):
    # V100 (7.0) and T4 (7.5) emulate bf16: torch.cuda.is_bf16_supported() says True there
    assert hardware.bf16_native(capability) == native


def fake_gpus(monkeypatch, *specs, current=0):
    """CUDA as it would report `specs`: (name, (major, minor), uuid) per device index."""
    props = [SimpleNamespace(name=name, major=cc[0], minor=cc[1], uuid=uuid) for name, cc, uuid in specs]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_bf16_on_a_v100_is_refused_with_the_fix(monkeypatch):
    fake_gpus(monkeypatch, ("Tesla V100-SXM2-32GB", (7, 0), "GPU-a"), ("Tesla V100-SXM2-32GB", (7, 0), "GPU-b"))
    problem = hardware.precision_problem("bf16", torch.device("cuda", 1))
    assert "GPU 1" in problem and "7.0" in problem and "train.precision=fp16" in problem
    assert hardware.precision_problem("fp16", torch.device("cuda", 1)) is None


def test_bf16_on_an_a100_and_anything_on_cpu_is_fine(monkeypatch):
    fake_gpus(monkeypatch, ("NVIDIA A100-SXM4-80GB", (8, 0), "GPU-a"))
    assert hardware.precision_problem("bf16", torch.device("cuda", 0)) is None
    assert hardware.precision_problem("bf16", torch.device("cpu")) is None


def test_low_precision_on_a_cpu_gets_a_note_that_names_fp32():
    for precision in ("bf16", "fp16"):
        note = hardware.precision_note(precision, torch.device("cpu"))
        assert note.startswith(f"note: train.precision={precision} on CPU") and "train.precision=fp32" in note
    assert hardware.precision_note("fp32", torch.device("cpu")) is None
    assert hardware.precision_note("bf16", torch.device("cuda", 0)) is None  # the GPU check is precision_problem's


def test_the_bf16_check_asks_the_ranks_own_gpu_and_allocates_nothing(monkeypatch):
    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(name="A100", major=8, minor=0, uuid="GPU-a")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: pytest.fail("allocates on the current GPU"))
    hardware.precision_problem("bf16", torch.device("cuda", 3))
    assert asked == [3]


def identities(monkeypatch, placements):
    """What each rank would report: (expected index, CUDA's current device, UUID of that device)."""
    found = []
    for expected, current, uuid in placements:
        fake_gpus(monkeypatch, *[("A100", (8, 0), uuid)] * (max(expected, current) + 1), current=current)
        found.append(hardware.device_identity(torch.device("cuda", expected)))
    return found


def test_ranks_on_their_own_gpus_pass(monkeypatch):
    assert hardware.device_problems(identities(monkeypatch, [(0, 0, "GPU-a"), (1, 1, "GPU-b")])) == []


def test_an_unbound_rank_is_caught_by_what_cuda_reports(monkeypatch):
    # rank 1 never called set_device: CUDA computes on device 0, which LOCAL_RANK cannot show
    problems = hardware.device_problems(identities(monkeypatch, [(0, 0, "GPU-a"), (1, 0, "GPU-a")]))
    assert any("rank 1 computes on cuda:0, not cuda:1" in p for p in problems)
    assert any("ranks [0, 1] share GPU GPU-a" in p for p in problems)


def test_two_ranks_on_one_physical_gpu_are_caught_by_uuid(monkeypatch):
    # each rank bound "its" device, but CUDA_VISIBLE_DEVICES mapped both to the same GPU
    problems = hardware.device_problems(identities(monkeypatch, [(0, 0, "GPU-a"), (1, 1, "GPU-a")]))
    assert len(problems) == 1 and "ranks [0, 1] share GPU GPU-a" in problems[0]


def test_the_same_uuid_on_two_hosts_is_not_shared():
    found = [("node1", 0, 0, "GPU-a"), ("node2", 0, 0, "GPU-a")]
    assert hardware.device_problems(found) == []


def test_the_cpu_identity_needs_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("no CUDA on a CPU run"))
    assert hardware.device_identity(torch.device("cpu"))[1:] == (-1, -1, "cpu")


def rows_by_topic(rows):
    return {topic: (verdict, detail) for verdict, topic, detail in rows}


def test_doctor_flags_bf16_on_volta_and_counts_gpus_like_the_launcher():
    found = [Gpu(0, "Tesla V100", (7, 0), "GPU-a"), Gpu(1, "Tesla V100", (7, 0), "GPU-b")]
    rows = rows_by_topic(diagnose.gpu_rows("bf16", found, "2.21.5", planned=8))
    assert rows["GPUs"][0] == checks.WARN and "2 visible (the count the launch scripts use)" in rows["GPUs"][1]
    assert rows["GPU 0"][0] == checks.FAIL and "train.precision=fp16" in rows["GPU 0"][1]
    assert rows["NCCL"] == (checks.PASS, "2.21.5")


def test_doctor_fails_without_nccl_and_warns_on_mig():
    found = [Gpu(0, "NVIDIA A100-SXM4-40GB MIG 3g.20gb", (8, 0), "MIG-a")]
    rows = rows_by_topic(diagnose.gpu_rows("bf16", found, None, planned=1))
    assert rows["NCCL"][0] == checks.FAIL
    assert rows["MIG"][0] == checks.WARN and "NPROC_PER_NODE=1" in rows["MIG"][1]
    assert rows["GPU 0"][0] == checks.PASS


def test_doctor_on_a_cpu_machine():
    ((verdict, topic, detail),) = diagnose.gpu_rows("bf16", [], None, planned=8)
    assert topic == "GPUs" and verdict == checks.WARN and "2 processes" in detail


def test_compile_with_syncbn_is_called_out():
    model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
    assert "pytorch#161302" in train.syncbn_compile_note(model, compile_model=True)
    assert train.syncbn_compile_note(model, compile_model=False) is None
    assert train.syncbn_compile_note(nn.Sequential(nn.BatchNorm1d(4)), compile_model=True) is None


def test_smoke_and_doctor_print_one_table_whose_failures_set_the_exit_code():
    rows = [(checks.PASS, "NCCL", "2.21.5"), (checks.WARN, "MIG", "one process"), (checks.SKIP, "GPU 0", "none")]
    assert checks.table("doctor", rows).splitlines() == [
        "PASS  NCCL   2.21.5",
        "WARN  MIG    one process",
        "SKIP  GPU 0  none",
        "doctor: PASS (0 failed, 1 warnings)",
    ]
    assert checks.exit_code(rows) == 0
    rows.append((checks.FAIL, "bf16", "emulated"))
    assert checks.table("smoke", rows).endswith("smoke: FAIL (1 failed, 1 warnings)") and checks.exit_code(rows) == 1


def test_peak_flops_come_from_the_config_a_known_gpu_or_nowhere(monkeypatch):
    assert hardware.peak_flops(torch.device("cpu"), "bf16", 312.5) == (312.5e12, "run.peak_tflops")
    assert hardware.peak_flops(torch.device("cpu"), "bf16", "auto")[0] is None  # n/a, not a made-up figure
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert hardware.peak_flops(torch.device("cuda", 0), "bf16", "auto") == (312e12, "NVIDIA A100-SXM4-80GB at bf16")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla V100-SXM2-16GB")
    peak, why = hardware.peak_flops(torch.device("cuda", 0), "bf16", "auto")
    assert peak is None and "set run.peak_tflops" in why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    assert hardware.peak_flops(torch.device("cuda", 0), "fp16", "auto")[0] == 756e12
