"""A torchvision classification model chosen by name, sized to the classes of the data.

`model.arch` is any name in `torchvision.models.list_models(module=torchvision.models)`
(resnet18, resnet50, efficientnet_b0, convnext_tiny, vit_b_16, ...). With `model.weights`
(DEFAULT, IMAGENET1K_V1, ...) the pretrained weights are downloaded once into the torch hub
cache ($TORCH_HOME) and the last linear layer is replaced by one for the data's classes;
without, the model starts from torchvision's own initialisation. BatchNorm layers become
SyncBatchNorm in train.py when `parallel.sync_batchnorm` is on. On CUDA the weights are kept
channels-last (NHWC), the layout tensor cores convolve fastest under AMP; task.py sends the
images in the same layout.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .base.rules import ConfigError
from .data import class_names

if TYPE_CHECKING:
    from .config import Config


@dataclass
class ModelConfig:
    arch: str = "resnet18"  # a torchvision.models classifier: resnet50, efficientnet_b0, vit_b_16, ...
    weights: str | None = None  # pretrained weights by name (DEFAULT, IMAGENET1K_V1, ...); null: random init


def build_model(cfg: Config) -> nn.Module:
    from torchvision import models

    check_arch(cfg.model.arch)
    classes = len(class_names(cfg))
    if cfg.model.weights is None:
        model = models.get_model(cfg.model.arch, num_classes=classes)
    else:
        model = pretrained_model(cfg.model.arch, cfg.model.weights)
        replace_head(model, classes, cfg.model.arch)
    return model.to(memory_format=image_layout(torch.device("cuda" if torch.cuda.is_available() else "cpu")))


def image_layout(device: torch.device) -> torch.memory_format:
    """Channels-last on CUDA (faster convolutions); the default layout elsewhere."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def check_arch(arch: str) -> None:
    from torchvision import models

    known = models.list_models(module=models)  # classifiers only: not detection or segmentation models
    if arch not in known:
        close = difflib.get_close_matches(arch, known, n=3) or known[:3]
        raise ConfigError(f"model.arch: {arch!r} is not a torchvision classifier; try {', '.join(close)}, ...")


def pretrained(arch: str, name: str):
    from torchvision import models

    choices = models.get_model_weights(arch)
    if name not in choices.__members__:
        raise ConfigError(f"model.weights: {arch} has no weights {name!r}; use one of {', '.join(choices.__members__)}")
    return choices[name]


def pretrained_model(arch: str, name: str) -> nn.Module:
    """The model with its pretrained weights, downloaded into the torch hub cache on first use."""
    from torchvision import models

    weights = pretrained(arch, name)
    try:
        return models.get_model(arch, weights=weights)
    except OSError as err:  # URLError and HTTPError are OSErrors: no network, a proxy, a full disk
        raise ConfigError(
            f"model.weights: {name} for {arch} could not be fetched from {weights.url} ({err}); on a machine "
            f"without network, fetch it once elsewhere and copy it into {torch.hub.get_dir()}/checkpoints"
        ) from None


def replace_head(model: nn.Module, classes: int, arch: str) -> None:
    """Swap the last linear layer for a fresh one with `classes` outputs (fine-tuning)."""
    linear = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linear:
        raise ConfigError(
            f"model.weights: {arch} ends in no linear layer to resize to {classes} classes; use weights=null"
        )
    name, head = linear[-1]
    if head.out_features != classes:
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, nn.Linear(head.in_features, classes))


def training_flops_per_image(cfg: Config, classes: int) -> float:
    """Forward + backward FLOPs for one image (3 x the forward), counted by torch on a weightless copy."""
    from torch.utils.flop_counter import FlopCounterMode
    from torchvision import models

    size = cfg.dataset.image_size
    with torch.device("meta"):  # shapes only: no memory, no arithmetic
        model = models.get_model(cfg.model.arch, num_classes=classes).eval()  # eval: BatchNorm takes a batch of 1
        with FlopCounterMode(display=False) as counter:
            model(torch.empty(1, 3, size, size))
    return 3.0 * counter.get_total_flops()
