"""Launch scripts, the smoke check and the diagnostics."""

import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    PACKAGE,
    PROJECT,
    SMOKE_CONFIG,
    WORLD_OF_ONE,
    model_needs,
    project_env,
    read_metrics,
    run,
    torchrun,
    train_losses,
)
from stand_ins import Progressions, Streams, install
from torch.utils.data import Subset

from {{ cookiecutter.package_name }} import config, task
from {{ cookiecutter.package_name }}.base import records
from {{ cookiecutter.package_name }}.loop import parallel
from {{ cookiecutter.package_name }}.tools import smoke

SCRIPTS = PROJECT / "scripts"
QUICK = ["data.num_workers=0", "run.tensorboard=false"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_scripts_are_executable_and_parse():
    for script in SCRIPTS.iterdir():
        if script.suffix in (".sh", ".sbatch"):
            run(["bash", "-n", str(script)])
            if script.name != "common.sh":
                assert script.stat().st_mode & stat.S_IXUSR, f"{script.name} is not executable"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_leaves_out_what_runs_write_and_the_data_folder_but_not_the_code(tmp_path):
    shutil.copy(PROJECT / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    written = ["runs/default/checkpoints/step_00000100.pt", "data/mine/train.bin", "data/packed/pack.json"]
    ours = [f"src/{PACKAGE}/data.py", "configs/default.yaml", "tests/test_task.py"]
    found = subprocess.run(["git", "check-ignore", *written, *ours], cwd=tmp_path, capture_output=True, text=True)
    assert found.stdout.split() == written


@pytest.mark.slow
def test_train_sh_trains_on_two_cpu_processes_while_29500_is_taken(tmp_path):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 29500))
        busy.listen()
        result = run(
            ["bash", "scripts/train.sh", "--config", SMOKE_CONFIG, f"run.out_dir={tmp_path}", "train.max_steps=20"],
            env=project_env(CUDA_VISIBLE_DEVICES=""),
            timeout=120,
        )
    assert "world size 2 (2 per node), backend gloo" in result.stdout
    assert "done: 20 steps" in result.stdout


@pytest.mark.slow
def test_scripts_resolve_a_relative_config_and_out_dir_where_they_are_run(tmp_path):
    (tmp_path / "mine.yaml").write_text(Path(SMOKE_CONFIG).read_text())
    command = [
        "bash",
        str(SCRIPTS / "train.sh"),
        "--config",
        "mine.yaml",
        "train.max_steps=5",
        "run.out_dir=here",
    ]
    result = subprocess.run(
        command, cwd=tmp_path, env=project_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "here" / "smoke" / "metrics.jsonl").exists()


TYPO = "config error: optim.lrr: unknown key; did you mean optim.lr? (from the command line's optim.lrr=1)"
FP16_UNDER_FSDP = "config error: " + (
    f"{parallel.floor_problem()} (from the command line's parallel.strategy=fsdp)"
    if parallel.floor_problem()  # a torch below the fsdp floor refuses the strategy first
    else "train.precision: fp16 under parallel.strategy=fsdp would let each rank skip its own overflowing "
    "steps (GradScaler sees only its shard): use bf16 (or fp32), or parallel.strategy=ddp "
    "(from the command line's train.precision=fp16)"
)


@pytest.mark.parametrize(
    ("script", "env"),
    [
        ("train.sh", {}),
        ("smoke.sh", {}),
        ("train_multinode.sh", {"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}),
    ],
)
@pytest.mark.parametrize(
    ("overrides", "line"),
    [(["optim.lrr=1"], TYPO), (["parallel.strategy=fsdp", "train.precision=fp16"], FP16_UNDER_FSDP)],
    ids=["composition", "a check of the settings"],
)
def test_a_config_mistake_is_one_line_and_exit_2_from_every_launcher_before_any_worker_starts(
    script, env, overrides, line
):
    # the node launcher builds and checks the settings once: not one line per rank and torchrun's report of them
    result = run(
        ["bash", f"scripts/{script}", "--config", SMOKE_CONFIG, *overrides],
        env=project_env(CUDA_VISIBLE_DEVICES="", **env),
        check=False,
    )
    assert (result.returncode, result.stderr.splitlines()) == (2, [line])


def multinode_env(tmp_path, **extra):
    return project_env(NNODES="2", NPROC_PER_NODE="1", CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo", **extra)


def two_nodes(tmp_path, envs: list[dict]) -> list[subprocess.CompletedProcess]:
    command = [
        "bash",
        "scripts/train_multinode.sh",
        "--config",
        SMOKE_CONFIG,
        f"run.out_dir={tmp_path}",
        "train.max_steps=20",
    ]
    nodes = [
        subprocess.Popen(command, cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]
    try:
        return (
            [subprocess.CompletedProcess(command, 0, *node.communicate(timeout=150)) for node in nodes]
            if all(node.wait(timeout=150) == 0 for node in nodes)
            else pytest.fail("\n".join(node.communicate()[1] for node in nodes))
        )
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.slow
def test_two_nodes_on_loopback_with_a_static_master(tmp_path):
    port = str(free_port())
    envs = [multinode_env(tmp_path, NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for rank in (0, 1)]
    first, _ = two_nodes(tmp_path, envs)
    assert "world size 2 (1 per node), backend gloo" in first.stdout
    assert len(train_losses(tmp_path / "smoke")) >= 2


@pytest.mark.slow
def test_two_nodes_on_loopback_with_c10d_rendezvous(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    envs = [multinode_env(tmp_path, RDZV_ENDPOINT=endpoint, RDZV_ID="loopback") for _ in (0, 1)]
    outputs = two_nodes(tmp_path, envs)
    assert any("world size 2 (1 per node), backend gloo" in o.stdout for o in outputs)


def smoke_rows(output: str) -> dict:
    rows = {}
    for line in output.splitlines():
        verdict, _, rest = line.partition("  ")
        if verdict in ("PASS", "WARN", "FAIL", "SKIP", "INFO"):
            name, _, detail = rest.strip().partition("  ")
            rows[name.strip()] = (verdict, detail.strip())
    return rows


@pytest.mark.task
def test_smoke_sh_passes_on_cpu_and_skips_gpu_checks_with_reasons(tmp_path):
    # the test-sized run (configs/default.yaml's may take hours on a CPU) under this project's
    # strategy and SyncBatchNorm setting; the rows expected are those the check gives that run
    project = config.load(PROJECT / "configs" / "default.yaml")
    settings = [
        f"parallel.strategy={project.parallel.strategy}",
        f"parallel.sync_batchnorm={str(project.parallel.sync_batchnorm).lower()}",
    ]
    result = run(
        ["bash", "scripts/smoke.sh", "--config", SMOKE_CONFIG, *settings, f"run.out_dir={tmp_path}"],
        env=project_env(CUDA_VISIBLE_DEVICES=""),
        timeout=180,
    )
    rows = smoke_rows(result.stdout)
    assert "smoke: PASS (0 failed" in result.stdout, result.stdout[-3000:]
    for check in (
        "backend",
        "gradients all-reduced",
        "parameters equal on all ranks",
        "loss decreases",
        "precision",
        "checkpoint round trip",
        "eval counts every sample once",
    ):
        assert rows[check][0] == "PASS", (check, rows[check])
    checked = config.load(SMOKE_CONFIG, settings)
    sharded = checked.parallel.strategy == "fsdp"
    assert ("reduce-scattered" in rows["gradients all-reduced"][1]) == sharded
    per_step = rows["one all-reduce per optimizer step"]
    assert per_step[0] == "SKIP" and "parallel.strategy=fsdp" in per_step[1] if sharded else per_step[0] == "PASS"
    assert rows["device per rank"][0] == "SKIP" and "CPU run" in rows["device per rank"][1]
    why = "needs CUDA" if checked.parallel.sync_batchnorm else "parallel.sync_batchnorm is off"
    assert rows["SyncBatchNorm"][0] == "SKIP" and why in rows["SyncBatchNorm"][1], rows["SyncBatchNorm"]
    assert rows["throughput"][0] == "INFO" and "evaluation and checkpoints included" in rows["throughput"][1]
    assert rows["precision"][1].startswith(f"{checked.train.precision}: autocast matmul in "), rows["precision"]


def smoke_checks(out_dir, *overrides: str) -> tuple[dict, config.Config]:
    """The smoke check's rows, {name: (verdict, detail)}, on the test-sized run with `overrides`, in
    this process (a world of one); and its config."""
    cfg = config.load(SMOKE_CONFIG, [*smoke.SMOKE_RUN, *QUICK, *overrides, f"run.out_dir={out_dir}"])
    return {what: (verdict, detail) for verdict, what, detail in smoke.run_checks(cfg, WORLD_OF_ONE)}, cfg


@pytest.mark.usefixtures("process_settings")
def test_the_smoke_check_evaluates_once_however_many_epochs_its_steps_span(tmp_path, monkeypatch):
    build_datasets = task.build_datasets

    def short_training_set(cfg):  # 64 samples: an epoch every 4 steps of 16
        train_set, eval_set = build_datasets(cfg)
        return Subset(train_set, range(64)), eval_set

    monkeypatch.setattr(task, "build_datasets", short_training_set)
    rows, cfg = smoke_checks(tmp_path, "train.epochs=9", "train.max_steps=12")
    evaluations = records.of_kind(read_metrics(cfg.run_dir), records.EVAL)
    assert [r["step"] for r in evaluations] == [12] and rows["eval counts every sample once"][0] == "PASS"


@pytest.mark.usefixtures("process_settings")
def test_the_smoke_check_evaluates_as_much_as_eval_limit_training_samples_hold(tmp_path, monkeypatch):
    install("recurrent", monkeypatch)  # windows of 7 tokens to train on, streams of 210 to evaluate
    monkeypatch.setattr(task, "build_datasets", lambda cfg: (Progressions(512, 0), Streams(20, 30)))
    rows, _ = smoke_checks(tmp_path, "train.max_steps=10", "eval.limit=60")
    verdict, detail = rows["eval counts every sample once"]
    assert verdict == "PASS" and detail.startswith("2 of 2 samples on 1 ranks; each holds 30x a training sample's")
    assert "the first 2, as much as 60 training samples (eval.limit)" in detail


@pytest.mark.slow
def test_smoke_fails_when_gradients_are_not_all_reduced(tmp_path):
    broken = str(PROJECT / "tests" / "broken_smoke.py")
    result = torchrun(broken, "--config", SMOKE_CONFIG, f"run.out_dir={tmp_path}", check=False, timeout=180)
    rows = smoke_rows(result.stdout)
    assert result.returncode != 0 and "smoke: FAIL" in result.stdout
    assert rows["gradients all-reduced"][0] == "FAIL"
    assert rows["parameters equal on all ranks"][0] == "FAIL"


def test_the_smoke_checks_run_keeps_loss_records_whatever_the_config():
    # the smoke check needs at least two loss records to judge the trend
    for path in (SMOKE_CONFIG, PROJECT / "configs" / "default.yaml"):
        cfg = config.load(path, smoke.SMOKE_RUN)
        assert cfg.train.max_steps >= 2 * cfg.run.log_every


def diagnose(*args, **kwargs):
    return run([sys.executable, "-m", f"{PACKAGE}.tools.diagnose", *args], **kwargs)


def test_diagnose_unused_lists_an_unused_head(capsys):
    assert diagnose_main("unused", "--config", SMOKE_CONFIG, "--model", "helpers:model_with_unused_head") == 1
    out = capsys.readouterr().out
    assert "aux_head.weight" in out and "aux_head.bias" in out and "body." not in out
    # the project's own model as its settings train it: every parameter gets a gradient, or a routed
    # model's experts that some batches leave without one are reduced (parallel.find_unused_parameters)
    assert diagnose_main("unused", "--config", SMOKE_CONFIG, *model_needs()) == 0, capsys.readouterr().out


def diagnose_main(*args: str) -> int:
    """`diagnose` as its command line runs it, in this process."""
    from {{ cookiecutter.package_name }}.tools import diagnose

    return diagnose.main(list(args))


def test_diagnose_doctor_flags_a_busy_port_and_oversubscription():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = diagnose(
            "doctor",
            "--config",
            SMOKE_CONFIG,
            "--nproc",
            "2",
            "--port",
            str(port),
            "--port",
            str(free_port()),
            f"data.num_workers={4 * os.cpu_count()}",
        )
    lines = result.stdout.splitlines()
    assert any(line.startswith("WARN") and f"port {port}" in line and "busy" in line for line in lines)
    assert any(line.startswith("PASS") and "free" in line for line in lines)
    assert any(line.startswith("WARN") and "oversubscribed" in line for line in lines)
    assert any("torch" in line for line in lines)


@pytest.mark.slow
def test_diagnose_scaling_reports_speedup_and_split(tmp_path):
    kept = tmp_path / "scaling"
    result = diagnose(
        "scaling", "--config", SMOKE_CONFIG, "--nproc", "2", "--steps", "30", "--out", str(kept), timeout=240
    )
    out = result.stdout
    assert "speedup" in out and "efficiency" in out
    assert "data wait" in out and "communication" in out
    assert any(band in out for band in ("good", "room to improve", "poor", "bottleneck"))
    # the step time split, 1 vs 2 processes: data wait, fwd+bwd, optimizer, other, step (ms)
    rows = {
        line.split("  ")[0]: line.split()[-5:]
        for line in out.splitlines()
        if line.startswith(("1 process ", "2 processes "))
    }
    assert set(rows) == {"1 process", "2 processes"}
    for cells in rows.values():
        data, fwd_bwd, optimizer, other, step = map(float, cells)
        assert fwd_bwd > 0 and optimizer > 0 and data + fwd_bwd + optimizer + other == pytest.approx(step, abs=0.05)
    assert (kept / "scale1" / "metrics.jsonl").exists() and (kept / "scale2" / "metrics.jsonl").exists()
    assert f"{PACKAGE}.tools.report {kept}/scale1 {kept}/scale2" in out
