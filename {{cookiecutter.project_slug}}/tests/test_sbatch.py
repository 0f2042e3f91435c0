"""The SLURM batch script, run with srun and scontrol replaced by stubs that record their arguments."""

import os

from conftest import PACKAGE, PROJECT, project_env, run


def slurm_stubs(tmp_path, srun_exit: int = 0) -> dict:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/srun.args\nexit {srun_exit}\n')
    (stubs / "scontrol").write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.args\n'
        '[ "$1" = show ] && printf "gpu-node-1\\ngpu-node-2\\n"\nexit 0\n'
    )
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = project_env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-node-[1-2]",
        SLURM_NNODES="2",
        SLURM_SUBMIT_DIR=str(PROJECT),
        SLURM_CPUS_ON_NODE="64",
    )
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    return env


def test_sbatch_builds_the_torchrun_command(tmp_path):
    run(["bash", "scripts/train.sbatch", "train.lr=3e-4"], env=slurm_stubs(tmp_path), timeout=30)
    args = (tmp_path / "srun.args").read_text().split()
    assert args[:2] == ["--kill-on-bad-exit=1", "torchrun"]
    assert "--nnodes=2" in args and "--rdzv-backend=c10d" in args and "--rdzv-id=4242" in args
    assert "--rdzv-endpoint=gpu-node-1:29622" in args and "--max-restarts=3" in args
    assert any(a.startswith("--nproc_per_node=") for a in args)
    assert args[args.index("-m") + 1] == f"{PACKAGE}.train"
    assert args[-3:] == ["run.name=slurm-4242", "checkpoint.resume=auto", "train.lr=3e-4"]


def test_sbatch_requeues_on_the_preemption_exit_code(tmp_path):
    result = run(["bash", "scripts/train.sbatch"], env=slurm_stubs(tmp_path, srun_exit=75), timeout=30)
    assert result.returncode == 0
    assert "requeue 4242" in (tmp_path / "scontrol.args").read_text()
