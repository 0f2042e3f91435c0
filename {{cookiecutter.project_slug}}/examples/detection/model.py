"""torchvision's Faster R-CNN: a loss dict in train mode, a list of detections in eval mode.

model.backbone picks its features: `small` (three convolutions, for the tests and the smoke
check on a CPU) or `mobilenet_v3` (torchvision's fasterrcnn_mobilenet_v3_large_fpn, from
scratch: a real run's, on GPUs). Either way the detector resizes each image to model.min_size,
pads the batch to its largest image and samples anchors and proposals with torch.randperm in its
forward: the proofs seed those draws alike on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torch import nn

from .base.rules import PositiveInt

if TYPE_CHECKING:
    from .config import Config


@dataclass
class ModelConfig:
    backbone: Literal["small", "mobilenet_v3"] = "small"  # small: tests and CPUs; mobilenet_v3: a real run
    width: PositiveInt = 32  # channels of the small backbone's features
    min_size: PositiveInt = 64  # the side each image is resized to (torchvision's min_size and max_size)


def build_model(cfg: Config) -> nn.Module:
    from torchvision.models.detection import FasterRCNN, fasterrcnn_mobilenet_v3_large_fpn
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    m, classes = cfg.model, cfg.dataset.classes + 1  # and the background
    sizes = dict(min_size=m.min_size, max_size=m.min_size)
    if m.backbone == "mobilenet_v3":
        return fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None, num_classes=classes, **sizes)
    backbone = nn.Sequential(*(layer for i in range(3) for layer in convolution(3 if i == 0 else m.width, m.width)))
    backbone.out_channels = m.width
    return FasterRCNN(
        backbone,
        num_classes=classes,
        rpn_anchor_generator=AnchorGenerator(sizes=((8, 16, 24),), aspect_ratios=((1.0,),)),
        box_roi_pool=MultiScaleRoIAlign(["0"], output_size=5, sampling_ratio=2),
        rpn_batch_size_per_image=64,
        box_batch_size_per_image=64,
        box_detections_per_img=20,
        **sizes,
    )


def convolution(inputs: int, outputs: int) -> list[nn.Module]:
    return [nn.Conv2d(inputs, outputs, 3, stride=2, padding=1), nn.ReLU()]
