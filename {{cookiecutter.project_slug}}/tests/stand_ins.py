"""Stand-in tasks that the suite installs in place of the project's seam, to hold the seam's
contract whatever model the project trains: the loop, every test and helper, the smoke check,
`diagnose` and the proofs reach the model only through the task's functions, pass its arguments
through unchanged, and the task reads its module's attributes through batching.unwrap.

    recurrent  forward(tokens, state) -> (logits, state): a state it cannot run without, from the
               module's own init_state (reached with unwrap: the model the task gets is wrapped)
    keyword    forward(*, input_ids, labels=None) -> {"loss": a mean, "logits"}: keyword arguments
               only, Hugging Face's shape; padded labels, so the loss terms vary; tied weights; its
               units named by class (_no_split_modules), as the model is built, not as sharded
    routed     keyword's, with a mixture of experts: each token goes to the expert its id picks, and
               an expert no token chose is skipped, so some batches leave it without a gradient;
               trained with parallel.find_unused_parameters=true, under ddp only (FSDP2 cannot)
    detector   torchvision's detectors' shape: images of different sizes and a list of per-image
               target dicts (a collate of its own), a loss dict in train mode and predictions in
               eval mode, negatives sampled with torch.randperm in the forward, images padded to
               the batch's largest and centred on its mean (so its outputs depend on the batch), and
               mAP at IoU 0.5 over the whole evaluation set (eval_outputs, dataset_metrics)
    contrastive  SimCLR's shape: two views of a sample drawn per read (SeededSamples), negatives from
               every rank's batch (gather_from_ranks, LOSS_SPANS_RANKS), BatchNorm in the encoder,
               and a kNN accuracy against the training set's embeddings (reference_set)

Each is self-contained (its model, data and every task function) and small: seconds a run.

    torchrun --standalone --nproc_per_node=2 tests/stand_ins.py OUT [--fsdp]

runs the proofs (tests/dist_proofs.py, with `--fsdp` the sharded loop's too) and the smoke check
(under ddp, and fsdp with `--fsdp`) on each, in one process group; rank 0 prints each stand-in's
name, then the tables; the exit code is 1 if a proof or a check failed. With `--eval`, only each
one's evaluation of its initial weights (OUT/<name>/proofs-<world size>.json).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run as a script, without installing

from {{ cookiecutter.package_name }} import task  # noqa: E402
from {{ cookiecutter.package_name }}.base.across_ranks import gather_from_ranks  # noqa: E402
from {{ cookiecutter.package_name }}.base.batching import SeededSamples, Throughput, move_to, unwrap  # noqa: E402

VOCABULARY, WIDTH, LENGTH, EXPERTS = 16, 8, 6, 4  # tokens per sample: LENGTH + 1, the last one only a target
CLASSES, SQUARE, CELL, TEMPERATURE = 3, 3, 4, 0.2
IGNORE = -100
SEAM = ("MAIN_METRIC", "TERMS_PER_SAMPLE", "build_datasets", "build_model", "count_terms", "loss_sum", "throughput")
SEAM += ("to_device",)
OPTIONAL = ("shard_units", "build_optimizer", "build_scheduler", "build_records", "from_records", "pack_facts")
OPTIONAL += ("eval_sums", "metrics", "collate", "eval_outputs", "dataset_metrics", "reference_set", "LOSS_SPANS_RANKS")


class Progressions(Dataset):
    """Token sequences that step through the vocabulary by a stride the first two tokens reveal."""

    def __init__(self, size: int, offset: int):
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        index += self.offset
        start, stride = index % VOCABULARY, 1 + index // VOCABULARY % 3
        return (start + stride * torch.arange(LENGTH + 1)) % VOCABULARY


class Streams(Dataset):
    """`count` long samples, each the tokens of `windows` samples end to end: a stream to evaluate whole."""

    def __init__(self, count: int, windows: int):
        self.count, self.length = count, windows * (LENGTH + 1)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        return (index + torch.arange(self.length)) % VOCABULARY


def datasets(cfg) -> tuple[Dataset, Dataset]:
    return Progressions(512, 0), Progressions(61, 512)  # 61: uneven over 2 and 3 ranks


def accuracy_and_metrics(totals: dict) -> dict:
    return {"loss": totals["loss"] / totals["tokens"], "accuracy": totals["correct"] / totals["tokens"]}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden))


class Recurrent(nn.Module):
    """A recurrent-style model: the state enters every position and leaves as the last one."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.mix = nn.Linear(2 * WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.embedding(tokens)
        previous = self.embedding(tokens.roll(1, dims=1))  # the token before: the stride is learnable
        hidden = self.mix(torch.cat([embedded, previous], dim=2)) + state[:, None, :]
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden), hidden[:, -1].clone()  # not a view: FSDP's hooks see the output

    def init_state(self, batch: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(batch, WIDTH, device=device)


class RecurrentTask:
    """The seam of Recurrent: batches of (B, LENGTH + 1) tokens, one term per predicted token."""

    MAIN_METRIC = ("loss", "min")
    TERMS_PER_SAMPLE = LENGTH
    build_datasets = staticmethod(datasets)
    metrics = staticmethod(accuracy_and_metrics)
    to_device = staticmethod(move_to)

    @staticmethod
    def build_model(cfg) -> nn.Module:
        return Recurrent()

    @staticmethod
    def count_terms(batch) -> int:
        return batch[:, 1:].numel()

    @staticmethod
    def logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        state = unwrap(model).init_state(len(batch), batch.device)  # the module's method, under any wrapper
        logits, _ = model(batch[:, :-1], state)
        return logits.float()

    @staticmethod
    def loss_sum(model: nn.Module, batch) -> torch.Tensor:
        logits = RecurrentTask.logits(model, batch)
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")

    @staticmethod
    def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
        logits = RecurrentTask.logits(model, batch)
        losses = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        correct = (logits.argmax(dim=2) == batch[:, 1:]).float()
        tokens = torch.full_like(losses[:, 0], losses.shape[1])
        return {"loss": losses.sum(dim=1), "correct": correct.sum(dim=1), "tokens": tokens}

    @staticmethod
    def throughput(cfg, model: nn.Module) -> Throughput:
        return Throughput("tokens", LENGTH)


class Keyword(nn.Module):
    """Hugging Face's shape: keyword arguments only, a dict out, the mean loss over the labels it
    shifts itself, the head tied to the embedding, its blocks named by class in _no_split_modules."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCABULARY, WIDTH)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        nn.init.normal_(self.embed_tokens.weight, std=0.1)  # tied: small enough for the head's logits

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        hidden = self.mix(self.embed_tokens(input_ids) + self.embed_tokens(input_ids.roll(1, dims=1)), input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE)
        return {"loss": loss, "logits": logits}

    def mix(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return hidden  # Routed's experts go here


class Padded(Dataset):
    """{"input_ids", "labels"} samples; every third one ends in padding, its labels IGNORE there."""

    def __init__(self, tokens: Dataset):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]
        labels = ids.clone()
        if index % 3 == 2:
            labels[-2:] = IGNORE
        return {"input_ids": ids, "labels": labels}


class KeywordTask:
    """The seam of Keyword: dict batches, the loss terms counted (padding), the mean made a sum."""

    MAIN_METRIC = ("loss", "min")
    TERMS_PER_SAMPLE = None
    metrics = staticmethod(accuracy_and_metrics)
    to_device = staticmethod(move_to)

    @staticmethod
    def build_datasets(cfg) -> tuple[Dataset, Dataset]:
        return tuple(Padded(dataset) for dataset in datasets(cfg))

    @staticmethod
    def build_model(cfg) -> nn.Module:
        return Keyword()

    @staticmethod
    def count_terms(batch) -> int:
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    @staticmethod
    def loss_sum(model: nn.Module, batch) -> torch.Tensor:
        mean = model(input_ids=batch["input_ids"], labels=batch["labels"])["loss"]
        return mean * KeywordTask.count_terms(batch)

    @staticmethod
    def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
        logits = model(input_ids=batch["input_ids"])["logits"][:, :-1].float()
        labels = batch["labels"][:, 1:]
        valid = labels != IGNORE
        losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")
        correct = ((logits.argmax(dim=2) == labels) & valid).float()
        return {"loss": losses.sum(dim=1), "correct": correct.sum(dim=1), "tokens": valid.sum(dim=1).float()}

    @staticmethod
    def throughput(cfg, model: nn.Module) -> Throughput:
        return Throughput("tokens", LENGTH)

    @staticmethod
    def shard_units(model: nn.Module) -> list[nn.Module]:
        """The modules of the classes _no_split_modules names, as Hugging Face models are split (the
        embedding and the head share a weight: the root's)."""
        return [m for m in model.modules() if type(m).__name__ in model._no_split_modules]


class Routed(Keyword):
    """Keyword with a mixture of experts after the embedding: each token goes to the expert its id
    picks (hash routing), and an expert with no token in the batch is skipped, as Hugging Face's
    Mixtral skips it, so a batch without an expert's tokens leaves that expert without a gradient."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS)])

    def mix(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        route = input_ids * EXPERTS // VOCABULARY
        out = torch.zeros_like(hidden)
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if chosen.any():
                out[chosen] = expert(hidden[chosen]).to(out.dtype)  # under autocast: its own dtype
        return hidden + torch.tanh(out)


class RoutedTask(KeywordTask):
    """The seam of Routed: Keyword's, another model."""

    @staticmethod
    def build_model(cfg) -> nn.Module:
        return Routed()


class Scenes(Dataset):
    """One-channel images of 8 to 12 pixels a side, each with 0 to 2 squares of a class's brightness:
    (image, {"boxes": (n, 4) x0 y0 x1 y1, "labels": (n,)}), as torchvision's detection datasets give."""

    def __init__(self, size: int, offset: int):
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        index += self.offset
        draw = torch.Generator().manual_seed(index)
        side = 8 + index % 5
        image = 0.1 * torch.rand(1, side, side, generator=draw)
        boxes, labels = [], []
        for square in range(index % 3):
            x, y = (int(v) for v in torch.randint(0, side - SQUARE + 1, (2,), generator=draw))
            label = (index + square) % CLASSES
            image[0, y : y + SQUARE, x : x + SQUARE] = 0.4 + 0.3 * label
            boxes.append([x, y, x + SQUARE, y + SQUARE])
            labels.append(label)
        return image, {"boxes": torch.tensor(boxes, dtype=torch.float32).view(-1, 4), "labels": torch.tensor(labels)}


def scene_collate(samples: list) -> tuple[list, list]:
    """A batch of detection samples: (images, targets), two lists, as torchvision's references collate."""
    images, targets = zip(*samples, strict=True)
    return list(images), list(targets)


class Detector(nn.Module):
    """A grid detector: each CELL x CELL cell of the padded batch scores the classes (0: background)
    and regresses the box of the square whose centre it holds. Train mode: forward(images, targets)
    -> {"loss_classifier", "loss_box_reg"}, means over the cells it samples (every positive cell and
    randomly drawn negatives, as a region proposal network samples). Eval mode: forward(images) ->
    one {"boxes", "scores", "labels"} per image."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, CELL, stride=CELL))
        self.scores = nn.Conv2d(16, CLASSES + 1, 1)
        self.boxes = nn.Conv2d(16, 4, 1)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        side = -(-max(max(image.shape[1:]) for image in images) // CELL) * CELL  # the batch's largest, padded
        batch = torch.stack([F.pad(image, (0, side - image.shape[2], 0, side - image.shape[1])) for image in images])
        hidden = self.features(batch - batch.mean())  # centred on the batch: its outputs depend on the batch
        scores, boxes = self.scores(hidden).flatten(2).transpose(1, 2), self.boxes(hidden).flatten(2).transpose(1, 2)
        cells = torch.stack(torch.meshgrid(torch.arange(side // CELL), torch.arange(side // CELL), indexing="xy"))
        corners = (cells.flatten(1).T * CELL).to(batch.device, batch.dtype).repeat(1, 2)  # cell (x, y, x, y)
        if self.training:
            return self.losses(scores, corners + boxes * CELL, targets, corners)
        found = zip(scores, corners + boxes * CELL, images, strict=True)
        return [self.detections(image_scores, image_boxes, image) for image_scores, image_boxes, image in found]

    @staticmethod
    def losses(scores, boxes, targets, corners) -> dict[str, torch.Tensor]:
        classes = torch.zeros(scores.shape[:2], dtype=torch.long, device=scores.device)
        wanted = torch.zeros_like(boxes)
        for image, target in enumerate(targets):
            for box, label in zip(target["boxes"], target["labels"], strict=True):
                centre = (box[:2] + box[2:]) / 2
                index = int(((corners[:, :2] <= centre) & (centre < corners[:, :2] + CELL)).all(dim=1).nonzero()[0])
                classes[image, index], wanted[image, index] = label + 1, box
        positive = classes.flatten() > 0
        negatives = (~positive).nonzero().flatten()
        chosen = negatives[torch.randperm(len(negatives), device=negatives.device)[: 2 * int(positive.sum()) + 2]]
        sampled = torch.cat([positive.nonzero().flatten(), chosen])
        box_loss = F.smooth_l1_loss(boxes.flatten(0, 1)[positive], wanted.flatten(0, 1)[positive], reduction="sum")
        return {
            "loss_classifier": F.cross_entropy(scores.flatten(0, 1)[sampled].float(), classes.flatten()[sampled]),
            "loss_box_reg": box_loss / max(1, int(positive.sum())) / CELL,
        }

    @staticmethod
    def detections(scores, boxes, image) -> dict[str, torch.Tensor]:
        """Every cell inside the image whose likeliest class is not the background."""
        probabilities, labels = scores.float().softmax(dim=1).max(dim=1)
        inside = (boxes[:, 0] < image.shape[2]) & (boxes[:, 1] < image.shape[1])
        keep = (labels > 0) & inside
        return {"boxes": boxes[keep].float(), "scores": probabilities[keep], "labels": labels[keep] - 1}


def average_precision_50(outputs: list[dict]) -> float:
    """mAP at IoU 0.5 over every image (VOC's all-point AP, the mean over the classes present)."""
    precisions = []
    for label in range(CLASSES):
        truths = [output["truth_boxes"][output["truth_labels"] == label] for output in outputs]
        found = [
            (float(score), image, box)
            for image, output in enumerate(outputs)
            for score, box in zip(*(output[key][output["labels"] == label] for key in ("scores", "boxes")), strict=True)
        ]
        count = sum(len(t) for t in truths)
        if count == 0:
            continue
        matched, hits = [set() for _ in outputs], []
        for _, image, box in sorted(found, key=lambda item: -item[0]):
            overlaps = [(overlap(box, truth), k) for k, truth in enumerate(truths[image]) if k not in matched[image]]
            best = max(overlaps, default=(0.0, None))
            hits.append(best[0] >= 0.5)
            if best[0] >= 0.5:
                matched[image].add(best[1])
        true_positives = torch.tensor(hits, dtype=torch.float64).cumsum(0)
        recall = true_positives / count
        precision = true_positives / torch.arange(1, len(hits) + 1)
        envelope = torch.flip(torch.cummax(torch.flip(precision, [0]), 0).values, [0])
        steps = torch.diff(torch.cat([torch.zeros(1, dtype=torch.float64), recall]))
        precisions.append(float((steps * envelope).sum()) if hits else 0.0)
    return sum(precisions) / max(1, len(precisions))


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Intersection over union of two boxes."""
    inner = (torch.minimum(a[2:], b[2:]) - torch.maximum(a[:2], b[:2])).clamp(min=0).prod()
    return float(inner / ((a[2:] - a[:2]).prod() + (b[2:] - b[:2]).prod() - inner))


class DetectorTask:
    """The seam of Detector: a collate of its own, the mode decides the output, a dataset-level metric."""

    MAIN_METRIC = ("map50", "max")
    TERMS_PER_SAMPLE = 1  # the losses are means over the batch's sampled cells: the sum weighs them per image
    to_device = staticmethod(move_to)
    collate = staticmethod(scene_collate)

    @staticmethod
    def build_datasets(cfg) -> tuple[Dataset, Dataset]:
        return Scenes(512, 0), Scenes(61, 512)

    @staticmethod
    def build_model(cfg) -> nn.Module:
        return Detector()

    @staticmethod
    def count_terms(batch) -> int:
        return len(batch[0])

    @staticmethod
    def loss_sum(model: nn.Module, batch) -> torch.Tensor:
        images, targets = batch
        return sum(model(images, targets).values()) * len(images)

    @staticmethod
    def eval_outputs(model: nn.Module, batch) -> list[dict]:
        images, targets = batch
        truths = [{"truth_boxes": target["boxes"], "truth_labels": target["labels"]} for target in targets]
        return [found | truth for found, truth in zip(model(images), truths, strict=True)]

    @staticmethod
    def dataset_metrics(cfg, outputs: list[dict], reference) -> dict[str, float]:
        return {"map50": average_precision_50(outputs)}

    @staticmethod
    def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """Per-image sums beside the dataset's metric: the detections and their scores."""
        found = model(batch[0])
        return {
            "detections": torch.tensor([len(f["scores"]) for f in found], dtype=torch.float64),
            "score": torch.stack([f["scores"].double().sum() for f in found]),
        }

    @staticmethod
    def metrics(totals: dict) -> dict[str, float]:
        return {"detections": totals["detections"] / totals["samples"], "score": totals["score"] / totals["samples"]}

    @staticmethod
    def throughput(cfg, model: nn.Module) -> Throughput:
        return Throughput("images", 1)


class Views(Dataset):
    """{"views": two noisy views (2, WIDTH) of a point near its class's centre, "label"}: the noise is
    augmentation from torch's global generator, so SeededSamples draws it per read."""

    def __init__(self, points: Dataset):
        self.points = points

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> dict:
        sample = self.points[index]
        return {"views": sample["point"] + 0.3 * torch.randn(2, WIDTH), "label": sample["label"]}


class Points(Dataset):
    """{"point", "label"}: a point near one of CLASSES centres."""

    def __init__(self, size: int, offset: int):
        self.size, self.offset = size, offset
        self.centres = torch.randn(CLASSES, WIDTH, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        index += self.offset
        noise = 0.8 * torch.randn(WIDTH, generator=torch.Generator().manual_seed(index))
        return {"point": self.centres[index % CLASSES] + noise, "label": index % CLASSES}


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(WIDTH, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, WIDTH))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.layers(points), dim=-1)


class ContrastiveTask:
    """The seam of Encoder: InfoNCE of each view against the other views of every rank's batch."""

    MAIN_METRIC = ("knn_accuracy", "max")
    TERMS_PER_SAMPLE = 2  # each view is an anchor
    LOSS_SPANS_RANKS = True
    to_device = staticmethod(move_to)

    @staticmethod
    def build_datasets(cfg) -> tuple[Dataset, Dataset]:
        return SeededSamples(Views(Points(512, 0)), cfg.run.seed), Points(61, 512)

    @staticmethod
    def build_model(cfg) -> nn.Module:
        return Encoder()

    @staticmethod
    def count_terms(batch) -> int:
        return 2 * len(batch["label"])

    @staticmethod
    def loss_sum(model: nn.Module, batch) -> torch.Tensor:
        views = batch["views"]
        embedded = model(views.flatten(0, 1)).view(len(views), 2, -1)
        first_views, first = gather_from_ranks(embedded[:, 0])
        second_views, _ = gather_from_ranks(embedded[:, 1])
        positives = first + torch.arange(len(views), device=views.device)
        loss = F.cross_entropy(embedded[:, 0] @ second_views.T / TEMPERATURE, positives, reduction="sum")
        return loss + F.cross_entropy(embedded[:, 1] @ first_views.T / TEMPERATURE, positives, reduction="sum")

    @staticmethod
    def eval_outputs(model: nn.Module, batch) -> dict[str, torch.Tensor]:
        return {"embedding": model(batch["point"]).float(), "label": batch["label"]}

    @staticmethod
    def reference_set(cfg, train_set: Dataset) -> Dataset:
        return Points(len(train_set), 0)  # the training points, without augmentation

    @staticmethod
    def dataset_metrics(cfg, outputs: dict, reference: dict) -> dict[str, float]:
        nearest = (outputs["embedding"] @ reference["embedding"].T).topk(5, dim=1).indices
        votes = reference["label"][nearest].mode(dim=1).values
        return {"knn_accuracy": float((votes == outputs["label"]).double().mean())}

    @staticmethod
    def throughput(cfg, model: nn.Module) -> Throughput:
        return Throughput()


class PlainTask:
    """A classifier of the shipped classifier's shape (an MLP with BatchNorm on points near a few
    centres): what the tests of the loop's own wiring train (schedules, optimizers, resumes), the
    same loop whatever the project's model, in seconds whatever its cost."""

    MAIN_METRIC = ("accuracy", "max")
    TERMS_PER_SAMPLE = 1
    to_device = staticmethod(move_to)

    @staticmethod
    def build_datasets(cfg) -> tuple[Dataset, Dataset]:
        return Points(512, 0), Points(61, 512)

    @staticmethod
    def build_model(cfg) -> nn.Module:
        return nn.Sequential(nn.Linear(WIDTH, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES))

    @staticmethod
    def count_terms(batch) -> int:
        return len(batch["label"])

    @staticmethod
    def loss_sum(model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["point"]), batch["label"], reduction="sum")

    @staticmethod
    def eval_sums(model: nn.Module, batch) -> dict[str, torch.Tensor]:
        logits = model(batch["point"]).float()
        return {
            "loss": F.cross_entropy(logits, batch["label"], reduction="none"),
            "correct": (logits.argmax(dim=1) == batch["label"]).float(),
        }

    @staticmethod
    def metrics(totals: dict) -> dict[str, float]:
        return {"loss": totals["loss"] / totals["samples"], "accuracy": totals["correct"] / totals["samples"]}

    @staticmethod
    def throughput(cfg, model: nn.Module) -> Throughput:
        return Throughput()


STAND_INS = {
    "recurrent": RecurrentTask,
    "keyword": KeywordTask,
    "routed": RoutedTask,
    "detector": DetectorTask,
    "contrastive": ContrastiveTask,
}
LOOP_WIRING = {"plain": PlainTask}  # installed by the tests of the loop's own wiring, not a shape of the seam
# the settings a project training the stand-in would have: DDP must reduce the experts a rank's batch
# left without a gradient (FSDP2 cannot: its reduce-scatter sizes would differ between ranks, pytorch#158719)
SETTINGS = {"routed": ["parallel.find_unused_parameters=true"]}
DDP_ONLY = {"routed"}


def install(name: str, monkeypatch=None) -> None:
    """Put the stand-in `name` in place of the project's seam: its functions in the task module, and
    none of the project's optional ones (its shard_units would be handed a model it never saw).
    In a test, pass pytest's monkeypatch, which undoes it afterwards."""
    set_attribute = partial(monkeypatch.setattr, raising=False) if monkeypatch else setattr
    delete_attribute = monkeypatch.delattr if monkeypatch else delattr
    stand_in = (STAND_INS | LOOP_WIRING)[name]
    for attribute in OPTIONAL:
        if hasattr(task, attribute):
            delete_attribute(task, attribute)
    for attribute in (*SEAM, *(optional for optional in OPTIONAL if hasattr(stand_in, optional))):
        set_attribute(task, attribute, getattr(stand_in, attribute))


def main() -> int:
    import dist_proofs

    from {{ cookiecutter.package_name }} import config
    from {{ cookiecutter.package_name }}.base import dist
    from {{ cookiecutter.package_name }}.base.dist import DistInfo
    from {{ cookiecutter.package_name }}.loop import parallel
    from {{ cookiecutter.package_name }}.tools import smoke

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fsdp", action="store_true", help="also the sharded loop's proofs and smoke check")
    parser.add_argument("--eval", action="store_true", help="only each stand-in's evaluation of its initial weights")
    args = parser.parse_args()
    info = DistInfo.from_env()
    strategies = ["ddp", "fsdp"] if args.fsdp and not parallel.floor_problem() else ["ddp"]

    def prove_and_check() -> int:
        codes = []
        for name in STAND_INS:
            dist.print0(info, f"stand-in {name}")
            out = args.out / name
            out.mkdir(parents=True, exist_ok=True)
            its_strategies = ["ddp"] if name in DDP_ONLY else strategies
            if args.eval:
                install(name)
                proofs = argparse.Namespace(out=out, only="eval", resume=None, overrides=SETTINGS.get(name, []))
                codes.append(dist_proofs.prove(proofs, info))
                continue
            for only in (None, "fsdp") if "fsdp" in its_strategies else (None,):
                install(name)  # again: the weighting proof changes TERMS_PER_SAMPLE
                proofs = argparse.Namespace(out=out, only=only, resume=None, overrides=SETTINGS.get(name, []))
                codes.append(dist_proofs.prove(proofs, info))
            for strategy in its_strategies:
                install(name)
                overrides = [*smoke.SMOKE_RUN, "train.max_steps=20", f"parallel.strategy={strategy}"]
                overrides = [*SETTINGS.get(name, []), *overrides]
                cfg = config.load(dist_proofs.SMOKE, [*overrides, f"run.out_dir={out / strategy}"])
                codes.append(smoke.smoke(cfg, info))
        return max(codes)

    return dist.run_in_group(info, 1, prove_and_check)


if __name__ == "__main__":
    sys.exit(main())
