"""What this machine's GPUs are and can do, asked the way the launcher, the training start-up,
the smoke check and `diagnose doctor` all agree on.

Every question here names its device explicitly and reads device properties only, so asking it
opens no CUDA context: before a rank binds its GPU, anything that allocates lands on GPU 0.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

# Dense peak TFLOPS of one device (no sparsity), from the vendors' data sheets; fp32 without
# TF32, which this project leaves off. The first name fragment found in the device's name wins.
PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2}),
    ("H100 80GB HBM3", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),  # SXM
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),  # SXM2; bf16 is emulated
)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BF16_NATIVE = (8, 0)  # Ampere: bf16 tensor cores; below it bf16 is emulated, several times slower
FP16_TENSOR_CORES = (7, 0)  # Volta


def autocast(precision: str, device: torch.device):
    """The forward passes' precision (train.precision): bf16/fp16 autocast, or a disabled one for fp32."""
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision], enabled=precision != "fp32")


@dataclass(frozen=True)
class Gpu:
    index: int  # as CUDA numbers it for this process (after CUDA_VISIBLE_DEVICES)
    name: str
    capability: tuple[int, int]
    uuid: str  # the physical device (or MIG instance), whatever the numbering

    @property
    def is_mig(self) -> bool:
        return "MIG" in self.name


def visible_gpus() -> int:
    """GPUs this process may use: CUDA's count honours CUDA_VISIBLE_DEVICES, MIG and cgroups,
    which `nvidia-smi -L` does not; no CUDA context is created."""
    return torch.cuda.device_count()


def gpus() -> list[Gpu]:
    return [_gpu(i) for i in range(visible_gpus())]


def _gpu(index: int) -> Gpu:
    props = torch.cuda.get_device_properties(index)
    return Gpu(index, props.name, (props.major, props.minor), str(props.uuid))


def bf16_native(capability: tuple[int, int]) -> bool:
    """Whether bf16 runs on tensor cores. `torch.cuda.is_bf16_supported()` also says True where
    it is only emulated (V100, T4), and allocates on the current device to find out."""
    return tuple(capability) >= BF16_NATIVE


def precision_problem(precision: str, device: torch.device) -> str | None:
    """Why `precision` is wrong for `device`, or None; the message says what to use instead."""
    if precision != "bf16" or device.type != "cuda":
        return None
    gpu = _gpu(device.index)
    if bf16_native(gpu.capability):
        return None
    major, minor = gpu.capability
    return (
        f"train.precision: bf16 needs compute capability 8.0 (Ampere) or newer; GPU {gpu.index} "
        f"({gpu.name}) is {major}.{minor}, where bf16 is emulated and slow: use train.precision=fp16"
    )


def precision_note(precision: str, device: torch.device) -> str | None:
    """A warning for low-precision autocast on a CPU, where it is usually emulated; or None."""
    if precision == "fp32" or device.type != "cpu":
        return None
    return (
        f"note: train.precision={precision} on CPU: a CPU without {precision} units (AVX512 or AMX extensions) "
        "emulates it, several times slower than fp32 (convolutions 20x and more); pass train.precision=fp32 "
        "for CPU runs"
    )


def peak_flops(device: torch.device, precision: str, configured: float | str) -> tuple[float | None, str]:
    """One device's peak FLOP/s at `precision` for MFU, or None; and where the figure comes from."""
    if configured != "auto":
        return float(configured) * 1e12, "run.peak_tflops"
    if device.type != "cuda":
        return None, f"no peak figure for {device.type}; set run.peak_tflops to compare with one of your own"
    name = torch.cuda.get_device_name(device)
    peaks = next((peaks for fragment, peaks in PEAK_TFLOPS if fragment in name), {})
    if precision not in peaks:
        return None, f"no peak figure for {name} at {precision}; set run.peak_tflops"
    return peaks[precision] * 1e12, f"{name} at {precision}"


def device_identity(device: torch.device) -> tuple[str, int, int, str]:
    """(host, the device this rank should use, the one CUDA says it computes on, that GPU's UUID):
    what CUDA reports, so two ranks on one GPU show up whatever their LOCAL_RANK says."""
    if device.type != "cuda":
        return socket.gethostname(), -1, -1, "cpu"
    current = torch.cuda.current_device()
    return socket.gethostname(), device.index, current, _gpu(current).uuid


def device_problems(identities: list[tuple[str, int, int, str]]) -> list[str]:
    """What is wrong with where the ranks compute (rank i reported identities[i]); empty when
    every rank computes on its own device and no two ranks share a physical GPU."""
    problems = [
        f"rank {rank} computes on cuda:{current}, not cuda:{wanted}: call torch.cuda.set_device(local_rank)"
        for rank, (_, wanted, current, _) in enumerate(identities)
        if current != wanted
    ]
    owners: dict[tuple[str, str], list[int]] = {}
    for rank, (host, _, _, uuid) in enumerate(identities):
        owners.setdefault((host, uuid), []).append(rank)
    problems += [
        f"ranks {ranks} share GPU {uuid} on {host}: one process per GPU (CUDA_VISIBLE_DEVICES, NPROC_PER_NODE)"
        for (host, uuid), ranks in owners.items()
        if len(ranks) > 1
    ]
    return problems


def nccl_version() -> str | None:
    """NCCL's version, or None where this torch build has no NCCL."""
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return None
    return ".".join(map(str, torch.cuda.nccl.version()))
