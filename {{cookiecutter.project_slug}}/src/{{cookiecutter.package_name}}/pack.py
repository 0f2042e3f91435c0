"""Pack the task's datasets into shards, then train on them with `data.shards=OUT`.

    python -m {{ cookiecutter.package_name }}.pack OUT [--config configs/default.yaml] [section.key=value ...]

OUT is a folder or an s3:// URL. The training and evaluation sets that build_datasets(cfg)
returns (or, when data.py defines it, build_records(cfg): the raw records, such as encoded
images, that from_records turns into samples) are written in order, record i of a set as
record i of OUT/train or OUT/val, in chunks of --chunk-mb, by --workers processes. pack.json,
with what the seam's pack_facts(cfg) returns (class names, a vocabulary size), is written
last: a pack that was stopped part-way is left aside (a folder) or never finished (a URL), and
training refuses it. See the README's "Data at scale".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from . import config, shards, task
from .rules import ConfigError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a folder that does not exist yet, or an s3:// URL")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. dataset.root=/data/images")
    parser.add_argument("--config", default="configs/default.yaml", help="YAML file with the dataset's settings")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes that pack")
    parser.add_argument("--chunk-mb", type=float, default=64.0, help="chunk size in MB (litdata's default: 64)")
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


def write_pack(cfg, folder: Path, workers: int, chunk_mb: float) -> dict:
    """The shards of both sets in `folder`, then pack.json; returns pack.json's content."""
    litdata = shards.require_litdata()
    records = dict(zip(shards.SPLITS, build_records(cfg), strict=True))
    for split, dataset in records.items():
        print(f"packing {split}: {len(dataset)} records", flush=True)
        litdata.optimize(
            fn=RecordAt(dataset),
            inputs=list(range(len(dataset))),
            output_dir=str(folder / split),
            chunk_bytes=int(chunk_mb * 1024**2),
            num_workers=max(1, min(workers, len(dataset))),
            keep_data_ordered=True,  # record i of the set is record i of the split
            reorder_files=False,
            verbose=True,
        )
    facts = getattr(task, "pack_facts", None)
    meta = {
        "id": uuid.uuid4().hex[:12],
        "records": {split: len(dataset) for split, dataset in records.items()},
        "facts": facts(cfg) if facts else {},
        "dataset": config.to_dict(cfg)["dataset"],
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / shards.PACK_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def pack_to_folder(cfg, out: Path, workers: int, chunk_mb: float) -> dict:
    """Pack beside `out`, then rename: `out` appears whole or not at all."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"pack: {out} already exists and is not empty; choose a new folder or remove it")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a stopped pack left
    partial.mkdir(parents=True)
    meta = write_pack(cfg, partial, workers, chunk_mb)
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return meta


def pack_to_bucket(cfg, url: str, workers: int, chunk_mb: float) -> dict:
    """Pack into a local temporary folder, then upload it with pack.json last."""
    store = shards.Store(url)
    if store.read(shards.PACK_FILE) is not None:
        raise ConfigError(f"pack: {store.url(shards.PACK_FILE)} exists; choose a new URL or delete that pack")
    with tempfile.TemporaryDirectory(prefix="pack-") as folder:
        meta = write_pack(cfg, Path(folder), workers, chunk_mb)
        files = sorted(path for path in Path(folder).rglob("*") if path.is_file() and path.name != shards.PACK_FILE)
        print(f"uploading {len(files)} files to {url}", flush=True)
        for path in files:
            store.put(path, str(path.relative_to(folder)))
        store.put(Path(folder) / shards.PACK_FILE, shards.PACK_FILE)
    return meta


def main(argv=None) -> int:
    args = parse_args(argv)
    with config.exit_on_user_error():
        cfg = config.load(args.config, args.overrides)
        shards.require_litdata()
        pack = pack_to_bucket if shards.is_remote(args.out) else pack_to_folder
        meta = pack(cfg, args.out if shards.is_remote(args.out) else Path(args.out), args.workers, args.chunk_mb)
    counts = ", ".join(f"{split} {count}" for split, count in meta["records"].items())
    print(f"packed {counts} records into {args.out}; train on them with data.shards={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
