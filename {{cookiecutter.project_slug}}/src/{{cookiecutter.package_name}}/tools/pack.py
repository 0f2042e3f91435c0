"""Pack the task's datasets into shards, then train on them with `data.shards=OUT`.

    python -m {{ cookiecutter.package_name }}.tools.pack OUT [--config configs/default.yaml] [section.key=value ...]

OUT is a folder or an s3:// URL. The training and evaluation sets that build_datasets(cfg)
returns (or, when data.py defines it, build_records(cfg): the raw records, such as encoded
images, that from_records turns into samples) are written in chunks of --chunk-mb by --workers
processes: the evaluation records in order, the training records in a random order drawn from
--seed and kept in OUT/train/order.npy, so that each chunk holds a random sample of them (a
dataset sorted by class or a text in order would otherwise give chunks of one class or one
passage, and a run reading chunk by chunk from object storage batches of them). pack.json, with
what the seam's pack_facts(cfg) returns (class names, a vocabulary size), is written last.

The packing runs in a process of its own (pack_writer.py) in a session of its own, and this command
stays with it: a stop (Ctrl-C, TERM, HUP) at any moment ends the packer and every process it
started, removes what it wrote and exits 130, 143 or 129 after one line; OUT gets nothing (a
folder is packed into OUT.partial and renamed at the end; a URL gets pack.json last, and
training refuses a pack without it). See docs/data-at-scale.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..base import processes

PARTIAL_SUFFIX = ".partial"  # a folder is packed beside OUT, then renamed to OUT


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a folder that does not exist yet (or is empty), or an s3:// URL")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. dataset.root=/data/images")
    # as config.add_config_option, without importing the settings (and torch) into this small supervisor
    files = "YAML file with the dataset's settings; repeat to apply files in order (default: configs/default.yaml)"
    parser.add_argument("--config", action="append", metavar="FILE", help=files)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="processes that pack")
    parser.add_argument("--chunk-mb", type=float, default=64.0, help="chunk size in MB (litdata's default: 64)")
    parser.add_argument("--seed", type=int, default=0, help="draws the order of the training records on disk")
    return parser


def is_url(out: str) -> bool:
    return "://" in out


def staging(out: str, workdir: Path) -> Path:
    """Where the packer writes the pack before it is put in place: beside a folder (a rename then
    makes it appear whole), or in this pack's work folder for a URL (uploaded from there)."""
    if is_url(out):
        return workdir / "pack"
    return Path(out).with_name(Path(out).name + PARTIAL_SUFFIX)


def main(argv=None) -> int:
    stop = processes.StopSignals()  # first: a stop at any moment ends with one line and its status
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_intermixed_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="pack-"))  # this pack's alone: litdata's caches, a URL's staging
    stage = staging(args.out, workdir)
    command, env = processes.module_command(
        f"{__package__}.pack_writer", *argv, "--stage", str(stage), "--workdir", str(workdir)
    )
    try:
        code = processes.run_child(command, stop, env=env)
    except processes.Stopped as stopped:
        sys.stderr.write(f"pack stopped by {stopped}; {left_behind(args.out)}\n")
        return stopped.exit_code
    finally:
        if not is_url(args.out):
            shutil.rmtree(stage, ignore_errors=True)  # what a stop or a failure left; a finished pack was renamed
        shutil.rmtree(workdir, ignore_errors=True)
    if code in (0, 2):  # 2: a config error, which the packer said in one line
        return code
    sys.stderr.write(f"pack failed (exit code {code}); {left_behind(args.out)}\n")
    return 1


def left_behind(out: str) -> str:
    if is_url(out):
        return f"{out} has no pack.json: training refuses what was uploaded, and packing to it again replaces it"
    return f"nothing was written to {out}"


if __name__ == "__main__":
    sys.exit(main())
