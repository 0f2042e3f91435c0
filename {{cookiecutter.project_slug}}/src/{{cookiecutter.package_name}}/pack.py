"""Pack the task's datasets into shards, then train on them with `data.shards=OUT`.

    python -m {{ cookiecutter.package_name }}.pack OUT [--config configs/default.yaml] [section.key=value ...]

OUT is a folder or an s3:// URL. The training and evaluation sets that build_datasets(cfg)
returns (or, when data.py defines it, build_records(cfg): the raw records, such as encoded
images, that from_records turns into samples) are written in chunks of --chunk-mb by --workers
processes: the evaluation records in order, the training records in a random order drawn from
--seed and kept in OUT/train/order.npy, so that each chunk holds a random sample of them (a
dataset sorted by class or a text in order would otherwise give chunks of one class or one
passage, and a run reading chunk by chunk from object storage batches of them). pack.json, with
what the seam's pack_facts(cfg) returns (class names, a vocabulary size), is written last: a
pack that was stopped part-way is left aside (a folder) or never finished (a URL), and training
refuses it. See the README's "Data at scale".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from . import config, shards, task
from .rules import ConfigError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a folder that does not exist yet (or is empty), or an s3:// URL")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. dataset.root=/data/images")
    parser.add_argument("--config", default="configs/default.yaml", help="YAML file with the dataset's settings")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes that pack")
    parser.add_argument("--chunk-mb", type=float, default=64.0, help="chunk size in MB (litdata's default: 64)")
    parser.add_argument("--seed", type=int, default=0, help="draws the order of the training records on disk")
    return parser.parse_intermixed_args(argv)


class RecordAt:
    """Record i of a set; pickled to litdata's packing processes."""

    def __init__(self, records):
        self.records = records

    def __call__(self, index: int):
        return self.records[index]


def build_records(cfg):
    """(train, eval) sets of what is stored: the seam's raw records, or the samples themselves."""
    build = getattr(task, "build_records", None)
    return build(cfg) if build else task.build_datasets(cfg)


def write_pack(cfg, folder: Path, workers: int, chunk_mb: float, seed: int) -> dict:
    """The shards of both sets in `folder`, then pack.json; returns pack.json's content."""
    records = dict(zip(shards.SPLITS, build_records(cfg), strict=True))
    if hasattr(records["train"], "set_epoch"):
        print(
            "warning: the training set has set_epoch, so its samples change each epoch, and a pack keeps one draw of "
            "them: define build_records and from_records in data.py to pack the records before augmentation"
        )
    order = np.random.default_rng(seed).permutation(len(records["train"]))
    for split, dataset in records.items():
        print(f"packing {split}: {len(dataset)} records", flush=True)
        inputs = order.tolist() if split == "train" else list(range(len(dataset)))
        pack_split(dataset, inputs, folder / split, int(chunk_mb * 1024**2), max(1, min(workers, len(dataset))))
    np.save(folder / "train" / shards.ORDER_FILE, order)
    facts = getattr(task, "pack_facts", None)
    meta = {
        "id": uuid.uuid4().hex[:12],
        "records": {split: len(dataset) for split, dataset in records.items()},
        "facts": facts(cfg) if facts else {},
        "dataset": config.to_dict(cfg)["dataset"],
        "seed": seed,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / shards.PACK_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def pack_split(records, inputs: list[int], folder: Path, chunk_bytes: int, workers: int) -> None:
    """litdata's optimize, writing records[inputs[j]] at position j, in a process of its own: on
    Ctrl-C its handler ends the process it runs in with exit code 0, which here would pass for a
    finished pack."""
    packing = multiprocessing.get_context("spawn").Process(
        target=optimize, args=(RecordAt(records), inputs, folder, chunk_bytes, workers)
    )
    packing.start()
    try:
        packing.join()
    except KeyboardInterrupt:
        packing.join()
        raise
    if packing.exitcode != 0 or not (folder / shards.INDEX_FILE).exists():
        raise PackStopped(f"packing {folder.name} stopped (exit code {packing.exitcode})")


def optimize(fn: RecordAt, inputs: list[int], folder: Path, chunk_bytes: int, workers: int) -> None:
    shards.require_litdata().optimize(
        fn=fn,
        inputs=inputs,
        output_dir=str(folder),
        chunk_bytes=chunk_bytes,
        num_workers=workers,
        keep_data_ordered=True,  # the record at position j is inputs[j]
        reorder_files=False,
        verbose=True,
    )


class PackStopped(Exception):
    """The pack did not finish; nothing was written where it was going."""


def pack_to_folder(cfg, out: Path, *options) -> dict:
    """Pack beside `out`, then rename: `out` appears whole or not at all."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"pack: {out} already exists and is not empty; choose a new folder or remove it")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a stopped pack left
    partial.mkdir(parents=True)
    try:
        meta = write_pack(cfg, partial, *options)
    except BaseException:  # a config error, Ctrl-C: no half-written folder stays behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return meta


def pack_to_bucket(cfg, url: str, *options) -> dict:
    """Pack into a local temporary folder, then upload it with pack.json last."""
    store = shards.Store(url)
    if store.read(shards.PACK_FILE) is not None:
        raise ConfigError(f"pack: {store.url(shards.PACK_FILE)} exists; choose a new URL or delete that pack")
    with tempfile.TemporaryDirectory(prefix="pack-") as folder:
        meta = write_pack(cfg, Path(folder), *options)
        files = sorted(path for path in Path(folder).rglob("*") if path.is_file() and path.name != shards.PACK_FILE)
        print(f"uploading {len(files)} files to {url}", flush=True)
        for path in files:
            store.put(path, str(path.relative_to(folder)))
        store.put(Path(folder) / shards.PACK_FILE, shards.PACK_FILE)
    return meta


def main(argv=None) -> int:
    args = parse_args(argv)
    with config.exit_on_user_error():
        if "://" in args.out and not shards.is_remote(args.out):
            raise ConfigError(f"pack: {args.out}: write to a folder or an s3:// URL")
        cfg = config.load(args.config, args.overrides)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shards=None))  # pack the source data
        shards.require_litdata()
        pack = pack_to_bucket if shards.is_remote(args.out) else pack_to_folder
        out = args.out if shards.is_remote(args.out) else Path(args.out)
        try:
            meta = pack(cfg, out, args.workers, args.chunk_mb, args.seed)
        except (KeyboardInterrupt, PackStopped) as stop:
            sys.stderr.write(f"pack stopped{f': {stop}' if str(stop) else ''}; nothing was written to {args.out}\n")
            return 130 if isinstance(stop, KeyboardInterrupt) else 1
    counts = ", ".join(f"{split} {count}" for split, count in meta["records"].items())
    print(f"packed {counts} records into {args.out}; train on them with data.shards={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
