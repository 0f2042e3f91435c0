"""A sample ImageFolder tree of coloured shapes: real JPEG files, made here, no network needed.

    python -m {{ cookiecutter.package_name }}.shapes DIR [--train-per-class 256] [--val-per-class 61] [--size 48]

writes DIR/train/<shape>/<n>.jpg and DIR/val/<shape>/<n>.jpg, one class per shape. Each image
is one shape in a random colour, size and place on a random background, so a model has to
learn the shape, not the colour. With `dataset.root: null` the project writes one itself (in
the system's temporary directory) and trains on it: the smoke check, the tests and a first
run need no data of yours.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

SHAPES = ("circle", "cross", "square", "star", "triangle")
SAMPLE = {"train_per_class": 256, "val_per_class": 61, "size": 40}  # 1280 + 305 images (305: odd, 5 x 61)
SAMPLE_VERSION = 2  # bump when the drawing changes, so that cached samples are redrawn


def polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """The outline of a shape of radius r centred on (cx, cy)."""
    if shape == "square":
        r *= 0.8  # the same area as the circle, near enough
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        corners = [math.pi / 2 + k * 2 * math.pi / 3 for k in range(3)]
        return [(cx + r * math.cos(a), cy - r * math.sin(a)) for a in corners]
    if shape == "star":
        points = [math.pi / 2 + k * math.pi / 5 for k in range(10)]
        return [(cx + (r if k % 2 == 0 else 0.45 * r) * math.cos(a), cy - (r if k % 2 == 0 else 0.45 * r) * math.sin(a))
                for k, a in enumerate(points)]  # fmt: skip
    if shape == "cross":
        w = r / 3
        return [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w), (cx + r, cy + w),
                (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r), (cx - w, cy + w), (cx - r, cy + w),
                (cx - r, cy - w), (cx - w, cy - w)]  # fmt: skip
    raise ValueError(f"unknown shape {shape!r}")


def distinct_colours(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A background and a foreground colour far enough apart to see the shape."""
    while True:
        background = tuple(rng.randrange(256) for _ in range(3))
        foreground = tuple(rng.randrange(256) for _ in range(3))
        if sum(abs(a - b) for a, b in zip(background, foreground, strict=True)) > 160:
            return background, foreground


def draw(shape: str, size: int, rng: random.Random):
    from PIL import Image, ImageDraw

    background, foreground = distinct_colours(rng)
    image = Image.new("RGB", (size, size), background)
    r = rng.uniform(0.3, 0.42) * size  # large and near the centre: a random crop keeps most of it
    cx, cy = (size / 2 + rng.uniform(-0.08, 0.08) * size for _ in range(2))
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=foreground)
    else:
        pen.polygon(polygon(shape, cx, cy, r), fill=foreground)
    return image


def write_tree(root: str | Path, train_per_class: int, val_per_class: int, size: int, seed: int = 0) -> Path:
    """Write the tree at `root` atomically: drawn in a scratch folder beside it, then renamed,
    so that ranks (or nodes) drawing the same sample at once never see half of one."""
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    rng = random.Random(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for shape in SHAPES:
            folder = scratch / split / shape
            folder.mkdir(parents=True)
            for n in range(count):
                draw(shape, size, rng).save(folder / f"{n:05d}.jpg", quality=90)
    try:
        os.rename(scratch, root)
    except OSError:  # another process finished the same tree first, or root existed
        shutil.rmtree(scratch, ignore_errors=True)
        if not root.is_dir():
            raise
    return root


def sample_root() -> Path:
    """The built-in sample (dataset.root: null), drawn on first use and kept for later runs."""
    name = f"{__package__}-shapes-v{SAMPLE_VERSION}-" + "-".join(str(value) for value in SAMPLE.values())
    root = Path(tempfile.gettempdir()) / name
    return root if root.is_dir() else write_tree(root, **SAMPLE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write a sample ImageFolder tree of coloured shapes.")
    parser.add_argument("root", type=Path, help="the tree to write (must not exist)")
    parser.add_argument("--train-per-class", type=int, default=SAMPLE["train_per_class"])
    parser.add_argument("--val-per-class", type=int, default=SAMPLE["val_per_class"])
    parser.add_argument("--size", type=int, default=SAMPLE["size"], help="side of each image in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.root.exists():
        parser.error(f"{args.root} exists; name a new folder")
    if min(args.train_per_class, args.val_per_class, args.size) < 1:
        parser.error("--train-per-class, --val-per-class and --size must be at least 1")
    write_tree(args.root, args.train_per_class, args.val_per_class, args.size, args.seed)
    images = len(SHAPES) * (args.train_per_class + args.val_per_class)
    print(f"wrote {images} images of {len(SHAPES)} classes to {args.root}; train with dataset.root={args.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
