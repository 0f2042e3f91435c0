"""Images from an ImageFolder tree, decoded and augmented in the loader workers.

    dataset.root/train/<class>/<image>     (.jpg, .png, ... : whatever PIL opens)
    dataset.root/val/<class>/<image>

One folder per class, the same classes in both splits; the classes are the sorted folder
names, and their number sizes the model's head. Training samples get the standard
augmentation (a random crop of `crop_scale` of the area, resized to `image_size`, and a
horizontal flip unless `hflip` is false); evaluation resizes the shorter side to `eval_resize`
and takes the centre `image_size` crop. Both normalise with `mean` and `std`. Without
`dataset.root` the project draws a sample tree of coloured shapes (shapes.py) and trains on that.

Packed (the pack command, then `data.shards`), a record is an image file's bytes and its label,
re-encoded first with the shorter side at `dataset.pack_max_side` when it is set: the loader
workers decode and augment records exactly as they do files, so a run on shards equals one on
the tree it was packed from.

The random augmentation of sample i in epoch e is drawn from generators seeded by (run.seed, e, i)
(base.batching.SeededSamples), not from the loader workers' streams: a run sees the same crops
whatever its world size or worker count, and a run resumed mid-epoch the same as an uninterrupted
one.
"""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from torch.utils.data import Dataset

from .base import packs
from .base.batching import SeededSamples
from .base.rules import ConfigError, PositiveInt, Rule
from .shapes import sample_root

if TYPE_CHECKING:
    from .config import Config

SPLITS = ("train", "val")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # ImageFolder's
MAKE_SAMPLE = "`python -m {{ cookiecutter.package_name }}.shapes DIR` writes a sample tree"


def _rgb(positive: bool) -> Rule:
    def holds(values) -> bool:
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        return len(values) == 3 and numbers and (not positive or min(values) > 0)

    return Rule(holds, f"use three {'positive ' if positive else ''}numbers: red, green, blue")


Channels = Annotated[list, _rgb(positive=False)]
PositiveChannels = Annotated[list, _rgb(positive=True)]
CropScale = Annotated[
    list, Rule(lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1, "use [min, max] with 0 < min <= max <= 1")
]


@dataclass
class DatasetConfig:
    root: str | None = None  # ImageFolder tree: root/train/<class>/*, root/val/<class>/*; null: a drawn sample
    image_size: PositiveInt = 32  # side of the training crop and of the eval centre crop, in pixels
    eval_resize: PositiveInt | None = None  # shorter side before the eval centre crop; null: image_size / 0.875
    crop_scale: CropScale = field(default_factory=lambda: [0.5, 1.0])  # area share of a random training crop
    hflip: bool = True  # random horizontal flips in training; false for digits, text, or what a mirror changes
    mean: Channels = field(default_factory=lambda: [0.485, 0.456, 0.406])  # per RGB channel; ImageNet's
    std: PositiveChannels = field(default_factory=lambda: [0.229, 0.224, 0.225])  # per RGB channel; ImageNet's
    pack_max_side: PositiveInt | None = None  # pack: re-encode images with a longer shorter side; null: as they are


def image_root(cfg: Config) -> Path:
    """The tree to train on, checked: a ConfigError lists every problem, one line each."""
    if cfg.dataset.root is None:
        return sample_root()
    root = Path(cfg.dataset.root)
    problems = tree_problems(root)
    if problems:
        raise ConfigError("\n".join(problems))
    return root


def tree_problems(root: Path) -> list[str]:
    """What keeps `root` from being an ImageFolder tree with train/ and val/ splits."""
    if not root.is_dir():
        return [
            f"dataset.root: {root} is not a folder; point it at an ImageFolder tree (root/train/<class>/<image>, "
            f"root/val/<class>/<image>), or {MAKE_SAMPLE}"
        ]
    problems, classes = [], {}
    for split in SPLITS:
        folder = root / split
        if not folder.is_dir():
            problems.append(
                f"dataset.root: {folder} is missing; the tree needs train/ and val/, each with one folder per class"
            )
            continue
        classes[split] = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
        if not classes[split]:
            problems.append(
                f"dataset.root: {folder} has no class folders; put each class's images in {folder}/<class>/"
            )
        problems += [
            f"dataset.root: {folder / name} holds no images (.jpg, .png, ...); add some or remove the folder"
            for name in classes[split]
            if not _has_image(folder / name)
        ]
    if len(classes) == 2 and classes["train"] and classes["val"] and classes["train"] != classes["val"]:
        only_train = sorted(set(classes["train"]) - set(classes["val"])) or ["-"]
        only_val = sorted(set(classes["val"]) - set(classes["train"])) or ["-"]
        problems.append(
            f"dataset.root: train/ and val/ hold different classes (only in train: {', '.join(only_train[:5])}; "
            f"only in val: {', '.join(only_val[:5])}); give both splits the same class folders"
        )
    return problems


def _has_image(folder: Path) -> bool:
    # ImageFolder also finds images in subfolders of a class; any() stops at the first
    return any(name.lower().endswith(IMAGE_SUFFIXES) for _, _, files in os.walk(folder) for name in files)


def class_names(cfg: Config) -> list[str]:
    if cfg.data.shards is not None:
        return packs.facts(cfg.data)["classes"]
    return sorted(entry.name for entry in os.scandir(image_root(cfg) / "train") if entry.is_dir())


def eval_resize(cfg: Config) -> int:
    return cfg.dataset.eval_resize or round(cfg.dataset.image_size / 0.875)  # 256 for 224, as ImageNet's recipes


def transforms(cfg: Config):
    """(train, eval) transforms: PIL image -> normalised float tensor (3, image_size, image_size)."""
    from torchvision import transforms as T

    d = cfg.dataset
    to_tensor = [T.ToTensor(), T.Normalize(d.mean, d.std)]
    flip = [T.RandomHorizontalFlip()] if d.hflip else []
    train = T.Compose([T.RandomResizedCrop(d.image_size, scale=tuple(d.crop_scale)), *flip, *to_tensor])
    evaluation = T.Compose([T.Resize(eval_resize(cfg)), T.CenterCrop(d.image_size), *to_tensor])
    return train, evaluation


def build_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    """(train, eval) datasets over the ImageFolder splits; a loader worker decodes each image."""
    from torchvision.datasets import ImageFolder

    root = image_root(cfg)
    train_transform, eval_transform = transforms(cfg)
    train = SeededSamples(ImageFolder(root / "train", train_transform), cfg.run.seed)  # crops drawn per read
    return train, ImageFolder(root / "val", eval_transform)


def encoded(path: str, max_side: int | None) -> bytes:
    """An image file's bytes as a pack stores them: as they are, or re-encoded (JPEG, quality 90)
    with the shorter side brought down to `max_side`, which makes decoding cheaper."""
    data = Path(path).read_bytes()
    if max_side is None:
        return data
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        if min(image.size) <= max_side:
            return data
        scale = max_side / min(image.size)
        size = (round(image.width * scale), round(image.height * scale))
        smaller = image.convert("RGB").resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    smaller.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


class DecodedImages(Dataset):
    """(image, label) from packed (encoded bytes, label) records, decoded as ImageFolder decodes files."""

    def __init__(self, records: Dataset, transform=None):
        self.records, self.transform = records, transform

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        from PIL import Image

        data, label = self.records[index]
        image = Image.open(io.BytesIO(data)).convert("RGB")
        return (self.transform(image) if self.transform else image), label


def build_records(cfg: Config) -> tuple[Dataset, Dataset]:
    """What the pack command stores: (encoded image, label) for each file of the two splits."""
    from torchvision.datasets import ImageFolder

    root, load = image_root(cfg), functools.partial(encoded, max_side=cfg.dataset.pack_max_side)
    return ImageFolder(root / "train", loader=load), ImageFolder(root / "val", loader=load)


def from_records(cfg: Config, train: Dataset, evaluation: Dataset) -> tuple[Dataset, Dataset]:
    """The training and evaluation datasets over packed records, transformed as build_datasets's."""
    train_transform, eval_transform = transforms(cfg)
    return SeededSamples(DecodedImages(train, train_transform), cfg.run.seed), DecodedImages(evaluation, eval_transform)


def pack_facts(cfg: Config) -> dict:
    """Kept in the pack: a run on shards has no tree to read its classes from."""
    return {"classes": class_names(cfg)}
