"""The image starter's training input read as an ImageFolder tree and as packed shards, side by side.

    python benchmarks/data.py [--rounds 3] [--batches 40] [--fixed 2] [--open-latency-ms 2]
    python benchmarks/data.py --quick    # a minute: one round, few batches, the rule's worker count only

Bakes a `task=image_classification` project, draws one tree of JPEGs (`shapes.write_tree`,
`--tree-size` px) and packs that same tree with the project's pack command (`dataset.root=TREE`).
The chunks are small (`--chunk-mb`) so that the pack, like any pack worth making, has many more
chunks than litdata keeps mapped per reader (4). 2 ranks launched with torchrun read the training
split through `loaders.datasets` (the tree, or `data.shards=PACK`: the same decode and
augmentation, bit for bit) in the project's training order (`loaders.train_sampler`: a global
shuffle of the tree, the pack chunk by chunk as `data.shards_order: chunks` reads it), either
only iterating the loader or running a small DDP training step per batch, with the worker
rule's count (`workers_per_rank`) and a fixed `--fixed` count per rank. Settings are interleaved
(every one once per round), so drifts in machine load hit all alike.

Slow file opens (the rows "slow"): tree and pack are on local disk, in the page cache. To stand
for a network filesystem (NFS, Lustre, EFS: a metadata round trip per open), every `open()` of a
file under the tree or the pack, in every process that reads (loader workers, or the rank itself
with 0 workers), first sleeps `--open-latency-ms`; the sleep takes no CPU, as a network wait does
not. The tree pays it once per image (torchvision's loader opens each file), the pack once per
chunk file that litdata opens or reopens; the opens are counted, not assumed, and printed per
image. Not charged: directory listings (ImageFolder scans the tree before the timed window),
litdata's stats of a chunk it switches to (an NFS client's attribute cache may answer those;
this favours the pack), and bandwidth (every byte comes from memory).
"""

from __future__ import annotations

import argparse
import builtins
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overhead import TEMPLATE, torchrun

SOURCES = ("tree", "shards")
MODES = ("loader", "training")


def slow_opens(folders: list[str], latency_s: float, counts) -> None:
    """Make every open() of a file under `folders` wait `latency_s` first, counted in `counts`
    (slot 0: the rank itself, slot 1 + i: loader worker i); forked loader workers inherit it."""
    from torch.utils.data import get_worker_info

    real_open = builtins.open

    def open_slowly(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(tuple(folders)):
            time.sleep(latency_s)
            worker = get_worker_info()
            counts[worker.id + 1 if worker else 0] += 1  # one slot per process: no lost updates
        return real_open(file, *args, **kwargs)

    builtins.open = open_slowly  # PIL, torchvision, litdata and numpy's memmap all open through it


def read(args) -> tuple[int, float]:
    """(images, seconds) of this rank's timed batches: read, or read and trained on."""
    import torch
    import torch.distributed as dist
    from ddp_trainer import config
    from ddp_trainer.loop import loaders
    from torch.utils.data import DataLoader

    overrides = [f"dataset.root={args.tree}", f"dataset.image_size={args.image_size}"]
    if args.source == "shards":
        overrides.append(f"data.shards={args.pack}")
    cfg = config.load(None, overrides)
    train_set, _ = loaders.datasets(cfg)
    # the project's training order: a global shuffle of the tree, the pack chunk by chunk (data.shards_order)
    sampler = loaders.train_sampler(train_set, cfg, dist.get_world_size(), dist.get_rank())
    sampler.set_epoch(0)
    loader = DataLoader(
        train_set,
        batch_size=32,
        sampler=sampler,
        num_workers=args.worker,
        persistent_workers=args.worker > 0,
        drop_last=True,
    )
    if args.mode == "training":
        head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 5))
        model = torch.nn.parallel.DistributedDataParallel(head)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start, seen, step = None, 0, 0
    while step < args.batches:
        for images, targets in loader:
            if step == 2:  # workers started and warm
                start, seen = time.perf_counter(), 0
            if args.mode == "training":
                torch.nn.functional.cross_entropy(model(images), targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            seen += len(targets)
            step += 1
            if step == args.batches:
                break
    return seen, time.perf_counter() - start


def worker_main(args) -> None:
    """Runs inside torchrun: rank 0 writes the images/s of both ranks and the opens per image."""
    import torch
    import torch._dynamo  # noqa: F401  (DDP imports it; before the group, or it keeps the group alive)
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    opens = torch.zeros(1 + args.worker).share_memory_()  # before the loader workers fork, so they share it
    if args.open_latency_ms:
        slow_opens([args.tree + os.sep, args.pack + os.sep], args.open_latency_ms / 1000, opens)
    images, seconds = read(args)  # returned: its DDP model, which holds the group, is gone
    totals = torch.tensor([images, opens.sum().item()])
    dist.all_reduce(totals)
    if dist.get_rank() == 0:
        # opens over all images the ranks took, warm-up included (the few batches read ahead are not)
        per_image = totals[1].item() / (args.batches * 32 * dist.get_world_size())
        Path(args.out).write_text(json.dumps({"rate": totals[0].item() / seconds, "opens": per_image}))
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()  # module graphs hold cycles: the last reference to the group goes now, not at exit


def run(project: Path, data: dict, source: str, mode: str, workers: int, latency: float, args, scratch: Path):
    out = scratch / f"rate-{time.monotonic_ns()}"
    command = torchrun(
        __file__,
        *("--worker", str(workers), "--source", source, "--mode", mode, "--out", str(out)),
        *("--tree", data["tree"], "--pack", data["pack"], "--open-latency-ms", str(latency)),
        *("--batches", str(args.batches), "--image-size", str(args.image_size)),
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(project / "src"))
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
    return json.loads(out.read_text())


def prepare(project: Path, scratch: Path, args) -> dict:
    """Draw the tree and pack it; enough images that the timed batches stay within one epoch."""
    from ddp_trainer import shapes

    per_class = -(-(args.batches + 2) * 32 * 2 // len(shapes.SHAPES))
    tree, pack = scratch / "tree", scratch / "pack"
    shapes.write_tree(tree, per_class, 2, args.tree_size)
    command = [sys.executable, "-m", "ddp_trainer.tools.pack", str(pack), f"dataset.root={tree}"]
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    command += ["--config", "configs/default.yaml", "--chunk-mb", str(args.chunk_mb)]
    subprocess.run(command, cwd=project, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    files = list((tree / "train").rglob("*.jpg"))
    chunks = json.loads((pack / "train" / "index.json").read_text())["chunks"]
    return {
        "tree": str(tree),
        "pack": str(pack),
        "about": f"{len(files)} training JPEGs of {args.tree_size} px, "
        f"{sum(f.stat().st_size for f in files) / len(files) / 1024:.1f} KB on average; "
        f"pack: {len(chunks)} chunks of ~{len(files) // len(chunks)} images",
    }


def table(settings: list, results: dict, rule: int) -> str:
    lines = [
        "| mode | workers per rank | file opens | tree images/s | shards images/s | shards/tree (min-max) "
        "| opens per image, tree / shards |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in settings:
        (mode, workers, latency), tree, packed = setting, results[setting, "tree"], results[setting, "shards"]
        ratios = [p["rate"] / t["rate"] for t, p in zip(tree, packed, strict=True)]
        rates = [f"{statistics.median(r['rate'] for r in rs):.0f}" for rs in (tree, packed)]
        opens = " / ".join(f"{statistics.median(r['opens'] for r in rs):.3f}" for rs in (tree, packed))
        lines.append(
            f"| {mode} | {workers} ({'rule' if workers == rule else 'fixed'}) | "
            f"{f'slow, {latency:g} ms' if latency else 'local'} | {rates[0]} | {rates[1]} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {opens if latency else '-'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round, few batches, the rule's worker count only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40, help="batches of 32 per rank, the first 2 not timed")
    parser.add_argument("--fixed", type=int, default=2, help="the fixed worker count per rank to compare with")
    parser.add_argument("--open-latency-ms", type=float, default=2.0, help="the simulated wait of each file open")
    parser.add_argument("--image-size", type=int, default=112, help="side of the training crop")
    parser.add_argument("--tree-size", type=int, default=160, help="side of the drawn JPEGs")
    parser.add_argument("--chunk-mb", type=float, default=0.25, help="the pack's chunk size")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    for hidden in ("--source", "--mode", "--tree", "--pack", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker_main(args)
        return 0
    if args.quick:
        args.rounds, args.batches = 1, 12

    from cookiecutter.main import cookiecutter

    with tempfile.TemporaryDirectory() as scratch:
        extra = {"task": "image_classification"}
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=extra, output_dir=scratch))
        sys.path.insert(0, str(project / "src"))
        from ddp_trainer.base.cpus import cpus_available
        from ddp_trainer.loop.loaders import workers_per_rank

        data = prepare(project, Path(scratch), args)
        rule = workers_per_rank(cpus_available(), 2, cap=8)
        counts = [rule] if args.quick else list(dict.fromkeys([rule, args.fixed]))
        settings = [(m, w, lat) for lat in (0.0, args.open_latency_ms) for m in MODES for w in counts]
        results = {(setting, source): [] for setting in settings for source in SOURCES}
        for round_ in range(args.rounds):
            for setting in settings:
                for source in reversed(SOURCES) if round_ % 2 else SOURCES:  # which goes first alternates
                    results[setting, source].append(run(project, data, source, *setting, args, Path(scratch)))
    print(
        f"{cpus_available()} CPUs, 2 ranks x 1 thread, batch 32 per rank, {args.image_size} px crops; {data['about']}; "
        f"{args.rounds} round(s) of {args.batches - 2} timed batches per rank. Slow opens: every open() of a tree or "
        f"pack file first sleeps {args.open_latency_ms:g} ms (a network filesystem's round trip); opens counted, "
        "batches read ahead included"
    )
    print(table(settings, results, rule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
