"""Typed configuration: dataclasses <- YAML file <- `section.key=value` overrides.

Every field is documented next to its default. `load()` returns a validated `Config` or
raises `ConfigError` with a message that names the key, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

import yaml

Precision = Literal["bf16", "fp16", "fp32"]
LrScaling = Literal["auto", "linear", "sqrt", "none"]
Norm = Literal["batch", "layer"]


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""


@dataclass
class RunConfig:
    name: str = "default"  # run name: every output of the run goes to out_dir/name/
    out_dir: str = "runs"  # parent directory of all runs
    seed: int = 0  # the same seed on every rank, set before the model is built
    log_every: int = 10  # optimizer steps between log lines (and preemption/NaN checks)


@dataclass
class DataConfig:
    batch_size: int = 32  # per device; global = batch_size x world size x grad_accum_steps
    num_workers: int | Literal["auto"] = "auto"  # loader workers per rank; auto sizes from CPUs
    max_workers: int = 8  # cap for num_workers=auto
    prefetch_factor: int = 2  # batches each worker prepares ahead (only with workers > 0)
    train_samples: int = 16384  # size of the synthetic training set
    eval_samples: int = 2000  # size of the synthetic evaluation set
    num_features: int = 32  # input width of the synthetic data
    num_classes: int = 10  # classes of the synthetic data


@dataclass
class ModelConfig:
    hidden: int = 256  # width of the hidden layers
    depth: int = 2  # number of hidden blocks (Linear -> norm -> ReLU)
    norm: Norm = "batch"  # batch: BatchNorm (SyncBN-able); layer: LayerNorm (batch-size free)


@dataclass
class TrainConfig:
    epochs: int = 10  # passes over the training set
    max_steps: int | None = None  # optional cap on optimizer steps (null: no cap)
    grad_accum_steps: int = 1  # micro-batches per optimizer step; only the last all-reduces
    precision: Precision = "bf16"  # bf16 | fp16 (with GradScaler) | fp32
    compile: bool = False  # torch.compile the model before wrapping it in DDP
    sync_batchnorm: bool = True  # SyncBatchNorm across ranks (CUDA only; needs world > 1)
    lr: float = 1e-3  # learning rate tuned for reference_batch_size
    reference_batch_size: int = 32  # global batch at which lr was tuned
    lr_scaling: LrScaling = "auto"  # auto: linear up to 4x the reference batch, sqrt beyond
    warmup_fraction: float | Literal["auto"] = "auto"  # share of steps; auto: 1-5% by batch growth
    min_lr_ratio: float = 0.1  # cosine decay ends at lr x min_lr_ratio
    weight_decay: float = 0.01  # AdamW weight decay
    grad_clip: float | None = 1.0  # max global gradient norm (null: no clipping)
    cudnn_benchmark: bool = True  # let cuDNN pick the fastest kernels for fixed input sizes


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # optimizer steps between checkpoints (one is also written at the end)
    keep_last: int = 3  # checkpoints kept in out_dir/name/checkpoints/
    resume: str = "auto"  # auto: newest loadable checkpoint of this run; never; or a file path


@dataclass
class DistConfig:
    timeout_minutes: float = 30.0  # collective timeout; a short one turns a hang into a traceback
    bucket_cap_mb: int = 25  # DDP gradient bucket size
    find_unused_parameters: bool = False  # only if `diagnose unused` lists parameters you need
    static_graph: bool = False  # DDP static_graph: same used parameters every step
    gpus_per_node: int = 8  # what this project was planned for; launchers and doctor compare
    num_nodes: int = 1  # what this project was planned for


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name


def load(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- overrides, then validated."""
    tree: dict = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as err:
            raise ConfigError(f"config file {path}: {err.strerror}; pass an existing --config") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(tree).__name__}")
    for item in overrides:
        key, value = parse_override(item)
        set_path(tree, key, value)
    return from_dict(tree)


def parse_override(item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.lr=3e-4")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:
        return key.strip(), raw


def set_path(tree: dict, key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is not a section")
    node[leaf] = value


def from_dict(tree: dict) -> Config:
    sections = {}
    for name, cls in typing.get_type_hints(Config).items():
        values = tree.get(name) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{name}: expected a mapping of keys, got {values!r}")
        sections[name] = _build_section(name, cls, values)
    unknown = set(tree) - set(sections)
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown section; known: {', '.join(sections)}")
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _build_section(name: str, cls: type, values: dict):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key; known keys: {', '.join(sorted(known))}")
    return cls(**{key: _check_type(f"{name}.{key}", value, hints[key]) for key, value in values.items()})


def _check_type(key: str, value, expected):
    if typing.get_origin(expected) in (Union, types.UnionType):
        for option in typing.get_args(expected):
            try:
                return _check_type(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} is not {_describe(expected)}")
    if typing.get_origin(expected) is Literal:
        if value not in typing.get_args(expected):
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, typing.get_args(expected)))}")
        return value
    if expected is type(None):
        if value is not None:
            raise ConfigError(f"{key}: {value!r} is not null")
        return None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str):
        try:  # YAML 1.1 reads 3e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: {value!r} is not {_describe(expected)}")
    return value


def _describe(expected) -> str:
    if typing.get_origin(expected) in (Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(expected))
    if typing.get_origin(expected) is Literal:
        return " or ".join(repr(v) for v in typing.get_args(expected))
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string"}[expected]


def validate(cfg: Config) -> None:
    """Value checks the types cannot express; each names the key and the fix."""
    at_least_one = {
        "run.log_every": cfg.run.log_every,
        "data.batch_size": cfg.data.batch_size,
        "data.train_samples": cfg.data.train_samples,
        "data.eval_samples": cfg.data.eval_samples,
        "data.num_features": cfg.data.num_features,
        "data.max_workers": cfg.data.max_workers,
        "data.prefetch_factor": cfg.data.prefetch_factor,
        "model.hidden": cfg.model.hidden,
        "model.depth": cfg.model.depth,
        "train.epochs": cfg.train.epochs,
        "train.grad_accum_steps": cfg.train.grad_accum_steps,
        "train.reference_batch_size": cfg.train.reference_batch_size,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "dist.bucket_cap_mb": cfg.dist.bucket_cap_mb,
        "dist.gpus_per_node": cfg.dist.gpus_per_node,
        "dist.num_nodes": cfg.dist.num_nodes,
    }
    for key, value in at_least_one.items():
        if value < 1:
            raise ConfigError(f"{key}: {value} must be at least 1")
    checks = [
        ("data.num_classes", cfg.data.num_classes >= 2, "use at least 2 classes"),
        ("data.num_workers", cfg.data.num_workers == "auto" or cfg.data.num_workers >= 0, "use auto or >= 0"),
        ("train.max_steps", cfg.train.max_steps is None or cfg.train.max_steps >= 1, "use null or >= 1"),
        ("train.lr", cfg.train.lr > 0, "use a positive learning rate such as 1e-3"),
        (
            "train.warmup_fraction",
            cfg.train.warmup_fraction == "auto" or 0 <= cfg.train.warmup_fraction < 1,
            "use auto or a share in [0, 1), e.g. 0.03",
        ),
        ("train.min_lr_ratio", 0 <= cfg.train.min_lr_ratio <= 1, "use a ratio in [0, 1]"),
        ("train.weight_decay", cfg.train.weight_decay >= 0, "use >= 0"),
        ("train.grad_clip", cfg.train.grad_clip is None or cfg.train.grad_clip > 0, "use null or a positive norm"),
        ("dist.timeout_minutes", cfg.dist.timeout_minutes > 0, "use a positive number of minutes, e.g. 30"),
        ("run.name", bool(cfg.run.name) and "/" not in cfg.run.name, "use a plain directory name"),
    ]
    for key, ok, fix in checks:
        if not ok:
            raise ConfigError(f"{key}: {_value_at(cfg, key)!r} is invalid; {fix}")


def _value_at(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML; `load(path)` reads it back unchanged."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
