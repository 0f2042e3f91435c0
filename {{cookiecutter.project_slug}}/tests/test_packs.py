"""Packed shards (pack.py, packs.py): the training order over chunks, the checks of a pack, and
in the slow tier the pack command, exact resume and evaluation, the proofs and the smoke check
on shards, and object storage against an S3-compatible server started here on loopback."""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    PACKAGE,
    PROJECT,
    SMOKE_CONFIG,
    WORLD_OF_ONE,
    project_env,
    read_metrics,
    run,
    torchrun,
    train_args,
    wait_for,
)
from test_faults import EVERY_10, FAULTY, assert_bit_identical, final_state, worker_pid

from {{ cookiecutter.package_name }} import config, task
from {{ cookiecutter.package_name }}.base import extras, packs
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.loop import loaders, samplers, sharded_checkpoint

needs_litdata = pytest.mark.skipif(
    importlib.util.find_spec("litdata") is None, reason=f"litdata is not installed: {extras.install_line('litdata')}"
)
needs_moto = pytest.mark.skipif(
    importlib.util.find_spec("moto") is None, reason="no S3-compatible server to test with: pip install 'moto[server]'"
)
PROOFS = str(PROJECT / "tests" / "dist_proofs.py")
# the records each chunk holds: uneven sizes (a packing process's last chunk is short), in a pack's random order
CHUNKS = [chunk.tolist() for chunk in torch.randperm(43, generator=torch.Generator().manual_seed(0)).split(7)]


def chunk_order(world_size: int, rank: int, epoch: int = 0, skip: int = 0) -> list[int]:
    sampler = samplers.ChunkOrderSampler(range(43), CHUNKS, num_replicas=world_size, rank=rank, seed=3)
    sampler.set_epoch(epoch)
    sampler.skip = skip
    return list(sampler)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_chunk_order_gives_each_record_to_one_rank_once_and_every_rank_as_many(world_size):
    orders = [chunk_order(world_size, rank) for rank in range(world_size)]
    everything = [index for order in orders for index in order]
    assert len(set(everything)) == len(everything) == 43 // world_size * world_size
    assert {len(order) for order in orders} == {43 // world_size}
    # the order of the epoch does not depend on the world size: the ranks hold consecutive parts of it
    assert everything == chunk_order(1, 0)[: len(everything)]


def test_the_chunk_order_reads_chunk_after_chunk_and_changes_every_epoch():
    chunk_of = {index: number for number, chunk in enumerate(CHUNKS) for index in chunk}
    order = chunk_order(1, 0)
    visits = [chunk_of[i] for i in order]
    runs = [chunk for i, chunk in enumerate(visits) if i == 0 or chunk != visits[i - 1]]
    assert sorted(runs) == list(range(len(CHUNKS)))  # each chunk read in one go
    assert runs != sorted(runs) and chunk_order(1, 0, epoch=1) != order  # shuffled, and anew each epoch
    assert order[:7] != sorted(order[:7])  # the records within a chunk too
    assert chunk_order(2, 1, skip=4) == chunk_order(2, 1)[4:]  # a resume mid-epoch continues the same order


def test_a_run_that_never_packs_imports_neither_litdata_nor_boto3():
    code = (
        f"import sys; from {PACKAGE} import config, train; from {PACKAGE}.loop import loaders\n"
        f"loaders.datasets(config.load({SMOKE_CONFIG!r}))\n"
        "print(sorted({'litdata', 'boto3', 'botocore'} & set(sys.modules)))"
    )
    assert run([sys.executable, "-c", code], timeout=60).stdout.strip() == "[]"


@needs_litdata
def test_a_folder_without_pack_json_is_one_config_error_naming_the_pack_command(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(ConfigError, match=f"{tmp_path}/pack.json does not exist.*python -m {PACKAGE}.tools.pack"):
        packs.open_pack(str(tmp_path))


def test_without_litdata_data_shards_is_one_config_error_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "litdata", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"litdata, which is not installed: pip install -e '\.\[shards\]'"):
        loaders.datasets(config.load(SMOKE_CONFIG, [f"data.shards={tmp_path}"]))


def test_data_shards_takes_a_folder_or_an_s3_url():
    assert config.load(SMOKE_CONFIG, ["data.shards=s3://bucket/packed"]).data.shards == "s3://bucket/packed"
    with pytest.raises(ConfigError, match="data.shards.*use null, a folder or an s3:// URL"):
        config.load(SMOKE_CONFIG, ["data.shards=gs://bucket/packed"])


def test_a_mid_epoch_resume_in_another_order_names_why_and_what_to_do():
    in_chunks = {"data": {"shards": "/data/packed", "shards_order": "chunks"}}
    unpacked = {"data": {"shards": None, "shards_order": "chunks"}}
    payload = {"world_size": 2, "batch_in_epoch": 3, "config": in_chunks}
    assert packs.resume_problem(payload, in_chunks) is None  # on any world size: samplers.py reads the rest
    assert packs.resume_problem(payload | {"batch_in_epoch": 0}, unpacked) is None  # an epoch's end
    problem = packs.resume_problem(payload, unpacked)
    assert "reading /data/packed chunk by chunk, and this run reads the records in one shuffle" in problem
    after_a_resize = payload | {"batch_in_epoch": 0, "earlier_layouts": [[2, 48]]}
    assert "chunk by chunk" in packs.resume_problem(after_a_resize, unpacked)
    # a shuffled pack's order is build_datasets's, sample for sample: switching between them mid-epoch is exact
    shuffled = {"data": {"shards": "/data/packed", "shards_order": "shuffle"}}
    assert packs.resume_problem(payload | {"config": shuffled}, unpacked) is None


def pack(out, *overrides: str, env: dict | None = None, timeout: float = 120):
    """The pack command as a user runs it, on the tests' dataset, in small chunks (many of them)."""
    command = [sys.executable, "-m", f"{PACKAGE}.tools.pack", str(out), "--config", SMOKE_CONFIG]
    return run([*command, "--workers", "2", "--chunk-mb", "0.02", *overrides], env=env, timeout=timeout)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("packs") / "smoke"
    assert f"train on them with data.shards={out}" in pack(out).stdout
    return str(out)


@pytest.mark.slow
@needs_litdata
def test_a_pack_holds_the_records_of_build_datasets_in_order(packed):
    meta = json.loads((Path(packed) / "pack.json").read_text())
    assert len(list((Path(packed) / "train").glob("*.bin"))) > 3  # several chunks
    order = np.load(Path(packed) / "train" / "order.npy")  # on disk, the training records in a random order
    assert sorted(order) == list(range(meta["records"]["train"])) and list(order) != sorted(order)
    from_shards = loaders.datasets(config.load(SMOKE_CONFIG, [f"data.shards={packed}"]))
    from_source = task.build_datasets(config.load(SMOKE_CONFIG))
    for split, records, samples in zip(packs.SPLITS, from_shards, from_source, strict=True):
        assert len(records) == len(samples) == meta["records"][split]
        for i in range(len(samples)):
            assert_bit_identical(records[i], samples[i], f"{split} record {i}")


@pytest.mark.slow
@needs_litdata
def test_training_on_shards_chunk_by_chunk_reaches_the_result_of_training_on_build_datasets(tmp_path, packed):
    name, goal = task.MAIN_METRIC
    finals = {}
    for run_name, source in (("source", []), ("shards", [f"data.shards={packed}"])):
        torchrun(*train_args(tmp_path, f"run.name={run_name}", *source), timeout=180)
        finals[run_name] = [r for r in read_metrics(tmp_path / run_name) if f"eval_{name}" in r][-1][f"eval_{name}"]
    # another order of the same records: not the same numbers, the same quality
    assert finals["shards"] == pytest.approx(finals["source"], abs=0.05), finals  # 0.833 and 0.817 here


LINGER_SECONDS = 3  # how long a process the pack command started may outlive it


class PackJob:
    """The pack command started as in a terminal (a process group of its own), on a pack large
    enough to stop at any point: many small chunks, one packing worker. Every process it starts
    carries a marker in its environment, so the test finds them wherever they end up."""

    STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C; a scheduler's stop; a closed terminal

    def __init__(self, out: Path):
        self.out, self.partial, self.marker = out, out.with_name(out.name + ".partial"), f"PACK_JOB={out}"
        command = [sys.executable, "-m", f"{PACKAGE}.tools.pack", str(out), "--config", SMOKE_CONFIG]
        command += ["--chunk-mb", "0.002", "--workers", "1"]
        self.process = subprocess.Popen(
            command,
            cwd=PROJECT,
            env=project_env(PACK_JOB=str(out)),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(target=lambda: self.stdout.extend(self.process.stdout), daemon=True),
            threading.Thread(target=lambda: self.stderr.append(self.process.stderr.read()), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def processes(self) -> list[int]:
        """The processes alive (zombies aside) that this pack started, the command included."""
        found = []
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and self.marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def chunks(self, split: str) -> bool:
        return any((self.partial / split).glob("*.bin"))

    def stop_when(self, reached, sig: int) -> tuple[int, str]:
        """Send `sig` to the command's group once `reached()`, as a terminal or a scheduler does;
        (exit code, stderr) once the command has exited, and after at most LINGER_SECONDS more
        for the processes it started (the test then counts those still alive)."""
        try:
            wait_for(reached, timeout=120)
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=60)
        finally:
            self.process.kill()
        deadline = time.monotonic() + LINGER_SECONDS
        for reader in self.readers:  # their output ends when the last process holding it has ended
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        return self.process.returncode, "".join(self.stderr)


# the points of a pack where a stop lands: what the test waits for before sending it
STOP_POINTS = {
    "before the first chunk": lambda job: len(job.processes()) > 1 and not job.chunks("train"),  # the packer is up
    "mid-train": lambda job: job.chunks("train"),
    "between the splits": lambda job: any(line.startswith("packing val") for line in job.stdout),
    "mid-eval": lambda job: job.chunks("val"),
}
# each point is stopped this many times, each time by the next of INT, TERM and HUP; before a
# release, or after a change to how pack ends, run more: PACK_STOP_ROUNDS=9
PACK_STOP_ROUNDS = int(os.environ.get("PACK_STOP_ROUNDS", "1"))


@pytest.mark.slow
@needs_litdata
def test_a_pack_stopped_at_any_point_exits_with_its_status_one_line_and_no_process_left(tmp_path):
    failures = []
    for round_ in range(PACK_STOP_ROUNDS):
        for index, (point, reached) in enumerate(STOP_POINTS.items()):
            sig = PackJob.STOPS[(round_ + index) % len(PackJob.STOPS)]
            job = PackJob(tmp_path / f"{round_}-{index}" / "packed")
            code, stderr = job.stop_when(lambda job=job, reached=reached: reached(job), sig)
            problems = stop_problems(job, sig, code, stderr)
            if problems:
                failures.append(f"{signal.Signals(sig).name} {point}: {'; '.join(problems)}")
    assert not failures, f"{len(failures)} of {PACK_STOP_ROUNDS * len(STOP_POINTS)} stops:\n" + "\n".join(failures)


def stop_problems(job: PackJob, sig: int, code: int, stderr: str) -> list[str]:
    """What is wrong with how a stopped pack ended: its status, its last line, what the stopped
    processes printed, what it left on disk and in the process table."""
    line = f"pack stopped by {signal.Signals(sig).name}; nothing was written to {job.out}\n"
    noise = [sign for sign in ("Traceback", "Interrupt", "leaked") if sign in stderr]
    checks = {
        f"exit {code}, not {128 + sig}": code == 128 + sig,
        f"stderr ends {stderr[-300:]!r}": stderr.endswith(line) and stderr.count(line) == 1,
        f"stderr holds {noise}": not noise,
        "the pack's folders are left": not job.out.exists() and not job.partial.exists(),
        f"processes left: {job.processes()}": not job.processes(),
    }
    return [problem for problem, holds in checks.items() if not holds]


@pytest.mark.slow
@needs_litdata
def test_a_pack_killed_outright_leaves_no_process_and_the_next_one_finishes(tmp_path):
    out = tmp_path / "packed"
    job = PackJob(out)
    # while the packer starts (silent: nothing tells it the command is gone but the kernel)
    code, _ = job.stop_when(lambda: STOP_POINTS["before the first chunk"](job), signal.SIGKILL)
    assert code == -signal.SIGKILL and not job.processes() and not out.exists()
    result = run([sys.executable, *train_args(tmp_path, f"data.shards={out}")], check=False, timeout=60)
    assert result.returncode == 2 and "is not a finished pack" in result.stderr
    pack(out)  # replaces what the killed one left
    assert (out / "pack.json").exists() and not job.partial.exists()


@pytest.mark.slow
@needs_litdata
def test_a_run_on_shards_killed_mid_epoch_resumes_bit_identical_to_an_uninterrupted_one(tmp_path, packed):
    # sharded checkpoints, written by ddp's ranks, where this torch writes them; full ones on
    # shards: the object-storage drill below; ddp's full ones on 1 rank: test_elastic.py
    steps = len(task.build_datasets(config.load(SMOKE_CONFIG))[0]) // 2 // 16 + 5  # into epoch 1
    sharded = not sharded_checkpoint.floor_problem()
    step_10 = "step_00000010" if sharded else "step_00000010.pt"
    overrides = (*EVERY_10, f"train.max_steps={steps}", f"data.shards={packed}")
    overrides += (f"checkpoint.format={'sharded' if sharded else 'full'}",)
    torchrun(*train_args(tmp_path / "straight", *overrides), timeout=120)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", FAULTY]
    command += train_args(tmp_path / "killed", *overrides)[2:]
    job = subprocess.Popen(command, cwd=PROJECT, env=project_env(FAULT="slow", FAULT_SECONDS="0.05"), text=True)
    try:
        wait_for((tmp_path / "killed" / "smoke" / "checkpoints" / step_10).exists, timeout=60)
        os.kill(worker_pid(job.pid, rank=1), signal.SIGKILL)  # mid-epoch 0, before step 20's checkpoint
        assert job.wait(timeout=60) != 0
    finally:
        job.kill()
    shutil.copytree(tmp_path / "killed", tmp_path / "alone")  # and on 1 rank: the rest of the epoch, in 2 micro-batches
    alone = run([sys.executable, *train_args(tmp_path / "alone", *overrides)], timeout=120)
    assert "on 1 rank from a 2-rank checkpoint: batch 16 x 1 x accum 2 keeps the global batch 32" in alone.stdout
    assert final_state(tmp_path / "alone" / "smoke", steps)["step"] == steps
    resumed = torchrun(*train_args(tmp_path / "killed", *overrides), timeout=120)
    assert f"{step_10} at step 10" in resumed.stdout
    result, straight = (final_state(tmp_path / name / "smoke", steps) for name in ("killed", "straight"))
    for part in ("model", "optimizer", "scheduler", "scaler", "step", "epoch"):
        assert_bit_identical(result[part], straight[part], part)


@pytest.mark.slow
@needs_litdata
def test_the_proofs_and_exact_evaluation_hold_on_shards_for_world_sizes_1_2_3(tmp_path, packed):
    on_shards = (f"data.shards={packed}",)
    proofs = torchrun(PROOFS, str(tmp_path), *on_shards, nproc=2, timeout=180)
    assert "proofs on 2 ranks: PASS (0 failed, 0 warnings)" in proofs.stdout
    torchrun(PROOFS, str(tmp_path), "--only", "eval", *on_shards, nproc=3, timeout=120)
    run([sys.executable, PROOFS, str(tmp_path), "--only", "eval", *on_shards], timeout=60)
    reference = json.loads((tmp_path / "proofs-1.json").read_text())["eval"]
    size = len(task.build_datasets(config.load(SMOKE_CONFIG))[1])
    for world in (1, 2, 3):
        results = json.loads((tmp_path / f"proofs-{world}.json").read_text())["eval"]
        assert results["eval_samples"] == results["dataset_size"] == size, world  # no padding counted, no tail lost
        assert results == pytest.approx(reference, rel=1e-6), world  # fp32 sums in another order


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory):
    """An S3-compatible server (moto's) on loopback with a bucket, and the standard AWS variables
    that point boto3 at it: the project's code runs unchanged."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    env = project_env(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, timeout=30)
        s3_client(env).create_bucket(Bucket="datasets")
        yield env
    finally:
        server.kill()


def s3_client(env: dict):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


@pytest.fixture(scope="module")
def s3_pack(s3_env) -> str:
    pack("s3://datasets/smoke", env=s3_env)
    return "s3://datasets/smoke"


@pytest.mark.slow
@needs_litdata
@needs_moto
def test_shards_in_object_storage_train_with_a_small_cache_and_resume_exactly(tmp_path, s3_env, s3_pack):
    cache = tmp_path / "cache"
    steps = 25  # mid-epoch 0: the crash at step 15 resumes from step 10's checkpoint
    overrides = (*EVERY_10, f"train.max_steps={steps}", f"data.shards={s3_pack}", "data.num_workers=1")
    overrides += (f"data.shards_cache={cache}", "data.shards_cache_gb=0.0001")  # 107 kB: a few chunks of 20 kB
    torchrun(*train_args(tmp_path / "straight", *overrides), env=s3_env, timeout=120)
    fault = s3_env | {"FAULT": "crash", "FAULT_RANK": "1", "FAULT_STEP": "15"}
    crashed = torchrun(FAULTY, *train_args(tmp_path / "crashed", *overrides)[2:], env=fault, check=False, timeout=120)
    assert crashed.returncode != 0 and "injected crash in step 15" in crashed.stderr
    resumed = torchrun(*train_args(tmp_path / "crashed", *overrides), env=s3_env, timeout=120)
    assert "step_00000010.pt at step 10" in resumed.stdout
    result, straight = (final_state(tmp_path / name / "smoke", steps) for name in ("crashed", "straight"))
    assert_bit_identical(result["model"], straight["model"], "model")
    cached = sum(path.stat().st_size for path in cache.rglob("*.bin"))
    assert cached <= 0.0001 * packs.GIGABYTE + 4 * 20 * 1024  # the limit, give or take the chunks being read


@pytest.mark.slow
@needs_litdata
@needs_moto
def test_from_object_storage_chunk_order_fetches_each_chunk_once_an_epoch(tmp_path, s3_env, s3_pack, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(name, s3_env[name])
    fetched = []
    fetch = packs.Store.fetch
    monkeypatch.setattr(packs.Store, "fetch", lambda store, name, to: (fetched.append(name), fetch(store, name, to)))

    def chunks_fetched(order: str, records: int) -> list[str]:
        """The training chunks fetched while one rank reads `records` records of epoch 0 through
        the project's loader, with a cache that holds a few chunks of the pack."""
        cache = (f"data.shards_cache={tmp_path / order}", "data.shards_cache_gb=0.0001")  # 107 kB: 5 chunks
        cfg = config.load(SMOKE_CONFIG, [f"data.shards={s3_pack}", f"data.shards_order={order}", *cache])
        train_set, eval_set = loaders.datasets(cfg)
        loader, _ = loaders.build_loaders(train_set, eval_set, cfg, WORLD_OF_ONE, 0)
        loader.sampler.set_epoch(0)
        fetched.clear()
        for _ in zip(range(records // cfg.data.batch_size), loader, strict=False):
            pass
        return [name for name in fetched if name.startswith("train/")]

    packed = {chunk["filename"] for chunk in packs.open_pack(s3_pack).indexes["train"]["chunks"]}
    in_chunk_order = chunks_fetched("chunks", records=packs.read_meta(s3_pack)["records"]["train"])
    assert sorted(in_chunk_order) == sorted(f"train/{name}" for name in packed)  # each chunk once an epoch
    # build_datasets' global shuffle over the same small cache: a fetch for most records read
    assert len(chunks_fetched("shuffle", records=256)) > 4 * len(packed)


@pytest.mark.slow
@needs_litdata
@needs_moto
def test_a_missing_chunk_or_unreachable_storage_is_one_line_on_every_rank(tmp_path, s3_env, s3_pack):
    s3 = s3_client(s3_env)
    for item in s3.list_objects_v2(Bucket="datasets", Prefix="smoke/")["Contents"]:  # a copy with a chunk lost
        if item["Key"] != "smoke/train/chunk-1-0.bin":
            source = {"Bucket": "datasets", "Key": item["Key"]}
            s3.copy_object(Bucket="datasets", Key=item["Key"].replace("smoke/", "broken/", 1), CopySource=source)
    start = time.monotonic()
    result = torchrun(*train_args(tmp_path, "data.shards=s3://datasets/broken"), env=s3_env, check=False, timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 60
    missing = "config error: data.shards: s3://datasets/broken/train/chunk-1-0.bin is missing"
    assert result.stderr.count(missing) == 2, result.stderr
    closed = s3_env | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    result = torchrun(*train_args(tmp_path, f"data.shards={s3_pack}"), env=closed, check=False, timeout=120)
    assert result.stderr.count(f"config error: data.shards: cannot read {s3_pack}/pack.json") == 2
