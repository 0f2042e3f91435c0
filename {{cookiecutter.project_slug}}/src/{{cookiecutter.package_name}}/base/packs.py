"""Packed shards: a run that reads what `python -m {{ cookiecutter.package_name }}.tools.pack` wrote instead of
calling `build_datasets`.

    data.shards: null                the task's datasets, as build_datasets(cfg) returns them
    data.shards: /data/packed        a folder here or on a shared filesystem (NFS, Lustre, ...)
    data.shards: s3://bucket/packed  object storage (S3 or compatible), cached on each node

A pack holds train/ and val/ in litdata's chunk format (chunks of ~64 MB: one file open per
thousands of samples instead of one per sample) and pack.json, written last: a pack without it
is unfinished and never trains. Record i of a split, as a ShardSet reads it, is record i of the
set the pack command read, so shards sit behind the same samplers, mid-epoch resume and exact
evaluation as any map-style dataset; the seam turns records into samples (`from_records` in
data.py: decode, augment), and without one the records are the samples. On disk the training
records are in a seeded random order (train/order.npy: the record at each position), so that a
chunk holds a random sample of the data, not one class or one stretch of text.

The training order goes chunk by chunk (samplers.ChunkOrderSampler; data.shards_order=chunks), so
a process opens, or fetches, a chunk once an epoch rather than once a sample;
data.shards_order=shuffle keeps build_datasets' global shuffle, sample for sample. From object
storage, each node fetches the chunks its loaders reach into `data.shards_cache`, once per node
(a file lock), and deletes the least recently used that nobody reads beyond
`data.shards_cache_gb`. Credentials come from where boto3 looks for them (the AWS_* variables,
~/.aws, an instance role), never from the config.
"""

from __future__ import annotations

import bisect
import fcntl
import functools
import hashlib
import io
import itertools
import json
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from . import extras
from .rules import ConfigError

PACK_FILE = "pack.json"
INDEX_FILE = "index.json"
ORDER_FILE = "order.npy"  # in train/: the record each position holds
SPLITS = ("train", "val")  # the (train, eval) pair of build_datasets, in that order
PACK_COMMAND = "python -m {{ cookiecutter.package_name }}.tools.pack"
GIGABYTE = 1024**3


class PackSettings(Protocol):
    """What reading a pack needs of the run's settings: their data section."""

    shards: str  # a folder or an s3:// URL
    shards_order: str  # chunks: chunk by chunk; shuffle: any order
    shards_cache: str | None  # the node's cache of a remote pack; None: default_cache()
    shards_cache_gb: float  # the size the cache stays under


def require_litdata(needed_for: str = "data.shards"):
    return extras.require("litdata", needed_for)


def datasets(data: PackSettings, from_records: Callable | None = None) -> tuple[Dataset, Dataset]:
    """The (train, eval) datasets of the pack that data.shards names: its record sets, or what
    `from_records(train, eval)` makes of them (the seam's, given the run's settings). Read chunk by
    chunk (data.shards_order=chunks), the training set carries the pack's chunk layout (InChunks)."""
    require_litdata()
    pack = open_pack(data.shards)
    sets = [ShardSet(pack, split, chunk_cache(data, pack, split)) for split in SPLITS]
    train, evaluation = from_records(*sets) if from_records else sets
    if data.shards_order == "chunks":
        train = InChunks(train, chunk_layout(pack))
    return train, evaluation


def facts(data: PackSettings) -> dict:
    """What the pack command recorded about the data (the seam's `pack_facts`: class names, ...),
    from the pack the data section (cfg.data) names."""
    data = getattr(data, "data", data)  # a whole run's settings, as projects made before this passed
    return read_meta(data.shards)["facts"]


def chunk_layout(pack: Pack) -> list[np.ndarray]:
    """The training records each chunk of the pack holds, in the order of the chunks."""
    sizes = [chunk["chunk_size"] for chunk in pack.indexes["train"]["chunks"]]
    return np.split(pack.order, list(itertools.accumulate(sizes))[:-1])


class InChunks(Dataset):
    """A pack's training set with its chunk layout (the records each chunk holds), which
    samplers.ChunkOrderSampler reads chunk by chunk. Indexing, length and set_epoch are the
    wrapped dataset's."""

    def __init__(self, dataset: Dataset, chunks: list[np.ndarray]):
        self.dataset, self.chunks = dataset, chunks

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[index]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def is_remote(location: str) -> bool:
    return location.startswith("s3://")


class Store:
    """Where a pack lives: a folder, or a prefix in an S3 bucket. Names are relative to it."""

    def __init__(self, location: str):
        self.location = location.rstrip("/")
        self.remote = is_remote(location)
        self.bucket, _, self.prefix = self.location.removeprefix("s3://").partition("/")

    def url(self, name: str) -> str:
        return f"{self.location}/{name}"

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        if not self.remote:
            path = Path(self.location) / name
            return path.read_bytes() if path.is_file() else None
        with self._named_errors(name):
            try:
                return s3().get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
            except s3().exceptions.NoSuchKey:
                return None

    def names(self, folder: str) -> set[str]:
        """The names of the files in `folder`."""
        if not self.remote:
            path = Path(self.location) / folder
            return {entry.name for entry in os.scandir(path)} if path.is_dir() else set()
        with self._named_errors(folder):
            pages = s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(folder) + "/")
            return {item["Key"].rsplit("/", 1)[-1] for page in pages for item in page.get("Contents", [])}

    def fetch(self, name: str, destination: Path) -> None:
        """Download a chunk during training; a failure is an error of the run, naming the chunk."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            s3().download_file(self.bucket, self._key(name), str(destination))
        except (BotoCoreError, ClientError) as err:
            gone = isinstance(err, ClientError) and err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey")
            why = "it was deleted after the run started; restore it or pack again" if gone else f"{err}"
            raise RuntimeError(f"data.shards: cannot fetch {self.url(name)}: {why}") from None

    def put(self, source: Path, name: str) -> None:
        with self._named_errors(name):
            s3().upload_file(str(source), self.bucket, self._key(name))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @contextmanager
    def _named_errors(self, name: str):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError) as err:
            raise ConfigError(
                f"data.shards: cannot read {self.url(name)} ({type(err).__name__}: {err}); check the URL, "
                "AWS_ENDPOINT_URL and the credentials (the AWS_* variables, ~/.aws or an instance role)"
            ) from None


def s3():
    """This process's S3 client (a loader worker makes its own: clients do not survive a fork)."""
    return _s3_client(os.getpid())


@functools.cache
def _s3_client(pid: int):
    boto3 = extras.require("boto3", "data.shards on s3://")
    from botocore.config import Config as BotoConfig

    # a few quick retries: unreachable storage is an error within a minute, not a hang
    retries = {"max_attempts": 3, "mode": "standard"}
    return boto3.client("s3", config=BotoConfig(connect_timeout=10, read_timeout=60, retries=retries))


@dataclass
class Pack:
    store: Store
    meta: dict  # pack.json
    indexes: dict  # split -> its index.json (litdata's: the chunks and the records each holds)
    order: np.ndarray  # the training record at each position of train/


@functools.cache
def read_meta(location: str) -> dict:
    """pack.json: what a pack holds, and the proof that it was finished."""
    require_litdata()  # a pack is of no use without it: say so before anything else fails
    store = Store(location)
    meta = store.read(PACK_FILE)
    if meta is None:
        raise ConfigError(
            f"data.shards: {store.url(PACK_FILE)} does not exist, so {location} is not a finished pack; "
            f"write one with `{PACK_COMMAND} {location}` and the dataset settings of the data to pack"
        )
    return json.loads(meta)


@functools.cache
def open_pack(location: str) -> Pack:
    """The pack at `location`, checked: finished, every chunk present, the record counts as packed."""
    store, meta, indexes = Store(location), read_meta(location), {}
    for split in SPLITS:
        index = json.loads(store.read(f"{split}/{INDEX_FILE}") or "null")
        files = [chunk["filename"] for chunk in index["chunks"]] + ([ORDER_FILE] if split == "train" else [])
        files = files if index else [INDEX_FILE]
        missing = sorted(set(files) - store.names(split)) if index else files
        if missing:
            raise ConfigError(
                f"data.shards: {store.url(f'{split}/{missing[0]}')} is missing ({len(missing)} of the pack's "
                f"{len(files)} files in {split}/); restore it or pack again with `{PACK_COMMAND} NEW_LOCATION`"
            )
        if sum(chunk["chunk_size"] for chunk in index["chunks"]) != meta["records"][split]:
            raise ConfigError(f"data.shards: {store.url(split)} holds other records than pack.json lists; pack again")
        indexes[split] = index
    order = np.load(io.BytesIO(store.read(f"train/{ORDER_FILE}") or b""))
    if sorted(order.tolist()) != list(range(meta["records"]["train"])):
        raise ConfigError(f"data.shards: {store.url(f'train/{ORDER_FILE}')} is not an order of the records; pack again")
    return Pack(store, meta, indexes, order)


class ShardSet(Dataset):
    """One split of a pack as a map-style dataset: item i is record i of the set that was packed."""

    def __init__(self, pack: Pack, split: str, cache: ChunkCache | None):
        chunks = pack.indexes[split]["chunks"]
        self.starts = list(itertools.accumulate((chunk["chunk_size"] for chunk in chunks), initial=0))
        self.positions = None  # where record i is stored; None: at position i
        if split == "train":
            self.positions = np.empty_like(pack.order)
            self.positions[pack.order] = np.arange(len(pack.order))
        self.directory = cache.directory if cache else Path(pack.store.location) / split
        self.cache = cache
        self.stream = None  # litdata's reader, opened in the process that reads (a loader worker)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        position = index if self.positions is None else int(self.positions[index])
        if self.stream is None:
            # one record decoded a read: litdata's default decodes a window of them, 4x slower by the record
            self.stream = require_litdata().StreamingDataset(str(self.directory), batch_decode=False)
        if self.cache is not None:
            self.cache.hold(bisect.bisect_right(self.starts, position) - 1)
        return owned(self.stream[position])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "stream": None}


def owned(record):
    """The record with tensors and arrays of its own: litdata's views of the chunk's read-only bytes
    must not reach a transform that writes in place."""
    if isinstance(record, (torch.Tensor, np.ndarray)):
        return record.copy() if isinstance(record, np.ndarray) else record.clone()
    if isinstance(record, dict):
        return {key: owned(value) for key, value in record.items()}
    if isinstance(record, (list, tuple)):
        return type(record)(owned(value) for value in record)
    return record


def chunk_cache(data: PackSettings, pack: Pack, split: str) -> ChunkCache | None:
    """The node's cache for a split of a remote pack (None for a folder: it is read in place)."""
    if not pack.store.remote:
        return None
    root = Path(data.shards_cache or default_cache())
    # a pack written again at the same URL gets a new id, so no stale chunk is ever read
    name = hashlib.sha256(pack.store.location.encode()).hexdigest()[:16] + "-" + pack.meta["id"]
    return ChunkCache(pack, split, root, root / name, int(data.shards_cache_gb * GIGABYTE))


def default_cache() -> Path:
    """Node-local: the temporary directory ($TMPDIR, which SLURM sets per job on many clusters), not
    a home directory on a shared filesystem."""
    return Path(tempfile.gettempdir()) / f"{{ cookiecutter.project_slug }}-shards-{os.getuid()}"


class ChunkCache:
    """A split's chunks, fetched into a local folder when the loader first reaches them; the
    folder (both splits) stays under `limit` bytes by deleting the least recently used chunks
    that no process of the node is reading (each reader holds a shared lock on its chunk)."""

    def __init__(self, pack: Pack, split: str, cache: Path, root: Path, limit: int):
        self.store, self.split, self.cache, self.limit = pack.store, split, cache, limit
        chunks = pack.indexes[split]["chunks"]
        self.files, self.sizes = [chunk["filename"] for chunk in chunks], [chunk["chunk_bytes"] for chunk in chunks]
        self.directory = root / split
        self.directory.mkdir(parents=True, exist_ok=True)
        index = self.directory / INDEX_FILE
        if not index.exists():
            publish(index, json.dumps(pack.indexes[split]).encode())
        self.held, self.reading = None, None  # the chunk this process reads now, and its shared lock

    def hold(self, chunk: int) -> None:
        """Make sure `chunk` is on local disk, and keep it there until this process reads another."""
        if chunk == self.held:
            return
        self.release()
        path = self.directory / self.files[chunk]
        self.reading = open(path.with_name(path.name + ".readers"), "w")  # noqa: SIM115 (held until release)
        fcntl.flock(self.reading, fcntl.LOCK_SH)
        with locked(path):  # one process of the node fetches it; the others wait and read it
            if path.exists() and path.stat().st_size == self.sizes[chunk]:  # not one cut short by a crash
                os.utime(path)  # most recently used: the last to be deleted
            else:
                partial = path.with_name(f"{path.name}.{os.getpid()}.part")
                self.store.fetch(f"{self.split}/{path.name}", partial)
                os.replace(partial, path)
                self.trim()
        self.held = chunk

    def release(self) -> None:
        if self.reading is not None:
            self.reading.close()  # and with it the shared lock
        self.held, self.reading = None, None

    def trim(self) -> None:
        """Delete the least recently used chunks nobody reads, of any pack, until the cache fits its limit."""
        with locked(self.cache / "trim"):  # one process at a time: none stats a file another deletes
            chunks = [(path.stat(), path) for path in self.cache.glob("*/*/*.bin")]
            size = sum(stat.st_size for stat, _ in chunks)
            for stat, path in sorted(chunks, key=lambda chunk: chunk[0].st_mtime):
                if size <= self.limit:
                    break
                with open(path.with_name(path.name + ".readers"), "w") as readers:
                    try:
                        fcntl.flock(readers, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue  # being read
                    size -= stat.st_size
                    path.unlink()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "held": None, "reading": None}  # a loader worker takes its own locks


@contextmanager
def locked(path: Path):
    """An exclusive lock beside `path`, shared by every process of the node."""
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def publish(path: Path, content: bytes) -> None:
    """Write a file whole or not at all: readers never see a partial one."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    partial.write_bytes(content)
    os.replace(partial, path)


def resume_problem(payload: dict, config: dict) -> str | None:
    """Why a run with settings `config` cannot resume from a checkpoint (`payload`) in the middle
    of the epoch it was written in, or None.

    The resumed run reads the records its epoch has not read yet, in the epoch's order: one
    shuffle of the records (no shards, or data.shards_order=shuffle) or chunk by chunk through one
    pack, on any world size (samplers.py). Another order would read some records twice and others
    never.
    """
    if not payload["batch_in_epoch"] and not payload.get("earlier_layouts"):
        return None
    before, now = order_of(payload["config"]), order_of(config)
    if before == now:
        return None
    return (
        f"was written in the middle of an epoch reading {describe_order(before)}, and this run reads "
        f"{describe_order(now)}; finish the epoch as it was written, or pass checkpoint.resume=never"
    )


def order_of(config: dict) -> str | None:
    """The pack a run reads chunk by chunk (data.shards_order=chunks), or None for one shuffle of the records."""
    data = config["data"]
    return data["shards"] if data["shards"] and data["shards_order"] == "chunks" else None


def describe_order(pack: str | None) -> str:
    return f"{pack} chunk by chunk" if pack else "the records in one shuffle (no data.shards, or shards_order=shuffle)"
