"""Three stand-in tasks that the suite installs in place of the project's seam, to hold the seam's
contract whatever model the project trains: the loop, every test and helper, the smoke check,
`diagnose` and the proofs reach the model only through the task's functions, pass its arguments
through unchanged, and the task reads its module's attributes through samples.unwrap.

    recurrent  forward(tokens, state) -> (logits, state): a state it cannot run without, from the
               module's own init_state (reached with unwrap: the model the task gets is wrapped)
    keyword    forward(*, input_ids, labels=None) -> {"loss": a mean, "logits"}: keyword arguments
               only, Hugging Face's shape; padded labels, so the loss terms vary; tied weights; its
               units named by class (_no_split_modules), as the model is built, not as sharded
    routed     keyword's, with a mixture of experts: each token goes to the expert its id picks, and
               an expert no token chose is skipped, so some batches leave it without a gradient;
               trained with parallel.find_unused_parameters=true, under ddp only (FSDP2 cannot)

Each is self-contained (its model, data and every task function) and small: seconds a run.

    torchrun --standalone --nproc_per_node=2 tests/stand_ins.py OUT [--fsdp]

runs the proofs (tests/dist_proofs.py, with `--fsdp` the sharded loop's too) and the smoke check
(under ddp, and fsdp with `--fsdp`) on each, in one process group; rank 0 prints each stand-in's
name, then the tables; the exit code is 1 if a proof or a check failed.
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
from {{ cookiecutter.package_name }}.base.batching import Throughput, move_to, unwrap  # noqa: E402

VOCABULARY, WIDTH, LENGTH, EXPERTS = 16, 8, 6, 4  # tokens per sample: LENGTH + 1, the last one only a target
IGNORE = -100
SEAM = (
    "MAIN_METRIC",
    "TERMS_PER_SAMPLE",
    "build_datasets",
    "build_model",
    "count_terms",
    "eval_sums",
    "loss_sum",
    "metrics",
    "throughput",
    "to_device",
)
OPTIONAL = ("shard_units", "build_optimizer", "build_scheduler", "build_records", "from_records", "pack_facts")


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


STAND_INS = {"recurrent": RecurrentTask, "keyword": KeywordTask, "routed": RoutedTask}
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
    stand_in = STAND_INS[name]
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
