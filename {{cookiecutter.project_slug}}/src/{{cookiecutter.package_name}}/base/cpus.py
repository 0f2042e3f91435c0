"""The CPUs a job owns on this node, and the threads each of its ranks gets: asked the same way by
the node launcher (OMP_NUM_THREADS for torchrun's workers), by training (torch's intra-op
threads) and by `diagnose`. Imports nothing heavy: the launcher uses it before torch is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def positive_int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask (taskset, cpusets, SLURM binding), capped by
    a cgroup CPU limit (Kubernetes' resources.limits.cpu, docker --cpus), which the mask does
    not show: a pod sees every CPU of its node and is throttled above its limit."""
    try:
        mask = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        mask = os.cpu_count() or 1
    limit = cpu_limit(cgroup)
    return min(mask, limit) if limit else mask


def cpu_limit(cgroup: Path) -> int | None:
    """The cgroup's CPU quota in whole CPUs (rounded up), or None without one: cgroup v2's
    cpu.max ("200000 100000", or "max 100000"), else v1's cpu.cfs_quota_us (-1: none)."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return max(1, -(-int(quota) // int(period)))


def job_cpus(env: Mapping[str, str], usable: int) -> int:
    """CPUs this job may use on this node: `usable` (usable_cpus()), capped by SLURM's allocation,
    which matters where SLURM does not bind tasks to CPUs (the mask is then the whole node). Inside
    an srun task (SLURM_STEP_ID set) the task owns SLURM_CPUS_PER_TASK; the batch shell owns the
    job's SLURM_CPUS_ON_NODE."""
    in_task = "SLURM_STEP_ID" in env
    allocated = positive_int(env.get("SLURM_CPUS_PER_TASK")) if in_task else None
    allocated = allocated or positive_int(env.get("SLURM_CPUS_ON_NODE"))
    return min(usable, allocated) if allocated else usable


def threads_per_process(cpus: int, processes: int) -> int:
    """torchrun's default of 1 thread starves CPU work; 0 (fewer CPUs than processes) is not a count."""
    return max(1, cpus // processes)


def threads_per_rank(env: Mapping[str, str], ranks_on_node: int, usable: int | None = None) -> int:
    """Threads for one of `ranks_on_node` ranks: OMP_NUM_THREADS when set (the user's, or the node
    launcher's), else the rank's share of the job's CPUs, so ranks do not oversubscribe them."""
    chosen = positive_int(env.get("OMP_NUM_THREADS"))
    return chosen or threads_per_process(job_cpus(env, usable or usable_cpus()), ranks_on_node)


def cpus_available() -> int:
    """CPUs this job owns on this node, seen from this process."""
    return job_cpus(os.environ, usable_cpus())
