"""Per-rank loader-worker sizing on the image starter's real decode pipeline.

    python benchmarks/workers.py [--pairs 3] [--naive 8] [--image-size 224]

Bakes a `task=image_classification` project; 2 ranks launched with torchrun read its training
set (the drawn sample tree: JPEG files decoded by PIL, random-resized-cropped to
`--image-size`, flipped, normalised) through DDP, each running a small training step per batch.
Compares the generated project's sizing (`workers_per_rank`: the rank's share of the CPUs minus
itself, capped) with 0 workers, 1 worker and a fixed `--naive` count per rank, interleaved
(every setting once per pair). Prints the images/s of each and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overhead import TEMPLATE, torchrun


def worker_main(num_workers: int, batches: int, image_size: int, out: str) -> None:
    """Runs inside torchrun: read `batches` batches through DDP and report images/s."""
    import torch
    import torch.distributed as dist
    from ddp_trainer import config, data
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train_set, _ = data.build_datasets(config.load(None, [f"dataset.image_size={image_size}"]))
    loader = DataLoader(
        train_set,
        batch_size=32,
        sampler=DistributedSampler(train_set, drop_last=True),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        drop_last=True,
    )
    head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 5))
    model = torch.nn.parallel.DistributedDataParallel(head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start, seen, step = None, torch.zeros(1), 0
    while step < batches:
        for images, targets in loader:
            if step == 2:  # workers started and warm
                start, seen = time.perf_counter(), torch.zeros(1)
            torch.nn.functional.cross_entropy(model(images), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seen += len(targets)
            step += 1
            if step == batches:
                break
    dist.all_reduce(seen)
    if dist.get_rank() == 0:
        Path(out).write_text(str(seen.item() / (time.perf_counter() - start)))
    dist.barrier()
    dist.destroy_process_group()


def run(project: Path, num_workers: int, args, scratch: Path) -> float:
    out = scratch / f"rate-{time.monotonic_ns()}"
    command = torchrun(
        __file__,
        "--worker",
        str(num_workers),
        "--batches",
        str(args.batches),
        "--image-size",
        str(args.image_size),
        "--out",
        str(out),
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(project / "src"))
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
    return float(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--naive", type=int, default=8, help="the fixed worker count per rank to compare with")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker_main(args.worker, args.batches, args.image_size, args.out)
        return 0

    from cookiecutter.main import cookiecutter

    with tempfile.TemporaryDirectory() as scratch:
        extra = {"task": "image_classification"}
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=extra, output_dir=scratch))
        sys.path.insert(0, str(project / "src"))
        from ddp_trainer.base.cpus import cpus_available
        from ddp_trainer.loop.loaders import workers_per_rank

        sized = workers_per_rank(cpus_available(), 2, cap=8)
        settings = {"sized (auto)": sized, "none": 0, "one": 1, "naive fixed": args.naive}
        rates = {name: [] for name in settings}
        for _ in range(args.pairs):
            for name, workers in settings.items():
                rates[name].append(run(project, workers, args, Path(scratch)))
    print(f"{cpus_available()} CPUs, 2 ranks, {args.image_size} px crops of the drawn JPEGs")
    print("| loader | workers per rank | images/s (median) | vs sized (min-max) |\n|---|---|---|---|")
    for name, workers in settings.items():
        ratios = [a / b for a, b in zip(rates[name], rates["sized (auto)"], strict=True)]
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"| {name} | {workers} | {statistics.median(rates[name]):.0f} | {spread} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
