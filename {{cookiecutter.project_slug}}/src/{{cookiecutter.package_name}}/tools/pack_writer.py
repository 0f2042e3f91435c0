"""The packing process that `python -m {{ cookiecutter.package_name }}.tools.pack` starts and supervises.

    python -m {{ cookiecutter.package_name }}.tools.pack_writer OUT [pack's options] --stage FOLDER --workdir FOLDER

It checks OUT and the settings, packs both splits into FOLDER with litdata (whose caches go
into the work folder, so that packs side by side never share one), writes pack.json last and
puts the pack in place: a rename to OUT, or an upload to the URL. It removes nothing when it
fails or is stopped: the pack command removes the stage and the work folder once every process
of this one's group has ended (see processes.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from .. import config, task
from ..base import packs, processes
from ..base.rules import ConfigError, exit_on_user_error
from . import pack


def parse_args(argv=None) -> argparse.Namespace:
    parser = pack.parser()
    parser.add_argument("--stage", type=Path, required=True, help="the folder to pack into")
    parser.add_argument("--workdir", type=Path, required=True, help="a folder of this pack's own for litdata's caches")
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
    records = dict(zip(packs.SPLITS, build_records(cfg), strict=True))
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
    np.save(folder / "train" / packs.ORDER_FILE, order)
    facts = getattr(task, "pack_facts", None)
    meta = {
        "id": uuid.uuid4().hex[:12],
        "records": {split: len(dataset) for split, dataset in records.items()},
        "facts": facts(cfg) if facts else {},
        "dataset": config.to_dict(cfg)["dataset"],
        "seed": seed,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / packs.PACK_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def pack_split(records, inputs: list[int], folder: Path, chunk_bytes: int, workers: int) -> None:
    """litdata's optimize, writing records[inputs[j]] at position j of `folder`."""
    packs.require_litdata().optimize(
        fn=RecordAt(records),
        inputs=inputs,
        output_dir=str(folder),
        chunk_bytes=chunk_bytes,
        num_workers=workers,
        keep_data_ordered=True,  # the record at position j is inputs[j]
        reorder_files=False,
        verbose=True,
    )


def pack_to_folder(cfg, out: Path, stage: Path, *options) -> dict:
    """Pack into `stage` beside `out`, then rename: `out` appears whole or not at all."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"pack: {out} already exists and is not empty; choose a new folder or remove it")
    shutil.rmtree(stage, ignore_errors=True)  # what a pack killed outright left
    stage.mkdir(parents=True)
    meta = write_pack(cfg, stage, *options)
    if out.exists():
        out.rmdir()
    stage.rename(out)
    return meta


def pack_to_bucket(cfg, url: str, stage: Path, *options) -> dict:
    """Pack into `stage`, a local folder, then upload it with pack.json last."""
    store = packs.Store(url)
    if store.read(packs.PACK_FILE) is not None:
        raise ConfigError(f"pack: {store.url(packs.PACK_FILE)} exists; choose a new URL or delete that pack")
    stage.mkdir(parents=True)
    meta = write_pack(cfg, stage, *options)
    files = sorted(path for path in stage.rglob("*") if path.is_file() and path.name != packs.PACK_FILE)
    print(f"uploading {len(files)} files to {url}", flush=True)
    for path in files:
        store.put(path, str(path.relative_to(stage)))
    store.put(stage / packs.PACK_FILE, packs.PACK_FILE)
    return meta


def main(argv=None) -> int:
    processes.end_group_on_term()  # the pack command's stop ends litdata's processes too
    args = parse_args(argv)
    # litdata empties its cache folders ($TMPDIR/chunks, $TMPDIR/data by default) at every start
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(args.workdir / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(args.workdir / "data")
    with exit_on_user_error():
        if pack.is_url(args.out) and not packs.is_remote(args.out):
            raise ConfigError(f"pack: {args.out}: write to a folder or an s3:// URL")
        cfg = config.load(config.files(args.config), args.overrides)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shards=None))  # pack the source data
        packs.require_litdata("the pack command")
        options = (args.stage, args.workers, args.chunk_mb, args.seed)
        if packs.is_remote(args.out):
            meta = pack_to_bucket(cfg, args.out, *options)
        else:
            meta = pack_to_folder(cfg, Path(args.out), *options)
    counts = ", ".join(f"{split} {count}" for split, count in meta["records"].items())
    print(f"packed {counts} records into {args.out}; train on them with data.shards={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
