"""Typed configuration: dataclasses <- YAML file <- `section.key=value` overrides.

Every field is documented next to its default, and its value rule sits in its type (see
rules.py). `load()` returns a validated `Config` or raises `ConfigError` with a message that
names the key, the bad value and the fix. The task's own settings live beside the code that
reads them: `ModelConfig` in model.py and `DatasetConfig` in data.py.

    python -m {{ cookiecutter.package_name }}.config sync configs/default.yaml   # rewrite it from the dataclasses
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml

from .data import DatasetConfig
from .model import ModelConfig
from .rules import ConfigError, PositiveFloat, PositiveInt, Rule, exit_on_user_error
from .rundir import RunDir
from .tracker_worker import TRACKERS

Precision = Literal["bf16", "fp16", "fp32"]
LrScaling = Literal["auto", "linear", "sqrt", "none"]
OptimizerName = Literal["adamw", "sgd", "adafactor", "task"]
Schedule = Literal["cosine", "linear", "constant", "wsd", "step", "task"]
ShardsOrder = Literal["chunks", "shuffle"]
WorkerStart = Literal["auto", "fork", "forkserver", "spawn"]
Strategy = Literal["ddp", "fsdp"]
Checkpointing = Literal["none", "full", "selective"]


NonNegative = Annotated[float, Rule(lambda v: v >= 0, "use >= 0")]
RunName = Annotated[str, Rule(lambda v: bool(v) and "/" not in v, "use a plain directory name")]
Workers = Annotated[int | Literal["auto"], Rule(lambda v: v == "auto" or v >= 0, "use auto or >= 0")]
StepCap = Annotated[int | None, Rule(lambda v: v is None or v >= 1, "use null or >= 1")]
LearningRate = Annotated[float, Rule(lambda v: v > 0, "use a positive learning rate such as 1e-3")]
Share = Annotated[float | Literal["auto"], Rule(lambda v: v == "auto" or 0 <= v < 1, "use auto or a share in [0, 1)")]
Ratio = Annotated[float, Rule(lambda v: 0 <= v <= 1, "use a ratio in [0, 1]")]
Betas = Annotated[
    list,
    Rule(
        lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v),
        "use [beta1, beta2], each in [0, 1), e.g. [0.9, 0.999]",
    ),
]
Milestones = Annotated[
    list,
    Rule(
        lambda v: all(isinstance(m, (int, float)) and 0 < m < 1 for m in v) and list(v) == sorted(v),
        "use increasing shares of the planned steps, each in (0, 1), e.g. [0.5, 0.75]",
    ),
]
ClipNorm = Annotated[float | None, Rule(lambda v: v is None or v > 0, "use null or a positive norm")]
Minutes = Annotated[float, Rule(lambda v: v > 0, "use a positive number of minutes, e.g. 30")]
Switch = bool | Literal["auto"]
ShardsLocation = Annotated[
    str | None,
    Rule(lambda v: v is None or "://" not in v or v.startswith("s3://"), "use null, a folder or an s3:// URL"),
]


def known_trackers_once(names: list) -> bool:
    return all(name in TRACKERS for name in names) and len(set(names)) == len(names)


TRACKERS_FIX = (
    f"name {', '.join(TRACKERS)} once each, e.g. [{', '.join(TRACKERS)}]; TensorBoard is not a tracker "
    "here but run.tensorboard"
)
Trackers = Annotated[list, Rule(known_trackers_once, TRACKERS_FIX)]
PeakTflops = Annotated[float | Literal["auto"], Rule(lambda v: v == "auto" or v > 0, "use auto or a positive number")]
StepWindow = Annotated[
    list | None,
    Rule(
        lambda v: v is None or (len(v) == 2 and all(type(s) is int for s in v) and 1 <= v[0] < v[1]),
        "use null or [start, stop] with 1 <= start < stop, e.g. [10, 15]",
    ),
]


@dataclass
class RunConfig:
    name: RunName = "default"  # run name: every output of the run goes to out_dir/name/
    out_dir: str = "runs"  # parent directory of all runs
    seed: int = 0  # the same seed on every rank, set before the model is built
    log_every: PositiveInt = 10  # optimizer steps between log lines (and preemption/NaN checks, as before checkpoints)
    tensorboard: Switch = "auto"  # TensorBoard event files in out_dir/name/tensorboard/; auto: on if installed
    trackers: Trackers = field(default_factory=list)  # wandb and/or mlflow, on global rank 0; their own env variables
    tracker_project: str | None = None  # W&B project / MLflow experiment; null: this project's name; env variables win
    tracker_timeout_s: PositiveFloat = 60.0  # longest a tracker call may take; a slower or failing tracker is dropped
    tracker_checkpoint: bool = False  # also upload the final checkpoint to the trackers
    profile_steps: StepWindow = None  # [start, stop]: trace steps start+1..stop into out_dir/name/profile/; null: off
    profile_ranks: Literal["main", "all"] = "main"  # ranks that write a profiler trace: main (rank 0) or all
    peak_tflops: PeakTflops = "auto"  # one device's peak, for MFU; auto: known GPUs by name and precision


@dataclass
class DataConfig:
    batch_size: PositiveInt = 32  # per device; global = batch_size x world size x grad_accum_steps
    num_workers: Workers = "auto"  # loader workers per rank; auto: the rank's share of CPUs - 1, capped
    max_workers: PositiveInt = 8  # cap for num_workers=auto
    prefetch_factor: PositiveInt = 2  # batches each worker prepares ahead (only with workers > 0)
    worker_start: WorkerStart = "auto"  # auto: fork, or forkserver where this Python's fork can hang a worker
    shards: ShardsLocation = None  # packed shards (the pack command): a folder or s3:// URL; null: build_datasets
    shards_order: ShardsOrder = "chunks"  # chunks: chunk by chunk, one open a chunk; shuffle: build_datasets' order
    shards_cache: str | None = None  # node-local folder caching s3:// shards; null: $TMPDIR/<project>-shards-<uid>
    shards_cache_gb: PositiveFloat = 50.0  # size the cache stays under (one chunk per loader worker at least)


@dataclass
class TrainConfig:
    epochs: PositiveInt = 10  # passes over the training set
    max_steps: StepCap = None  # optional cap on optimizer steps (null: no cap)
    grad_accum_steps: PositiveInt = 1  # micro-batches per optimizer step; only the last all-reduces
    strategy: Strategy = "ddp"  # ddp: a whole copy of the model on every device; fsdp: sharded over them (torch>=2.8)
    activation_checkpointing: Checkpointing = "none"  # recompute units in backward: full (all), selective (every 2nd)
    precision: Precision = "bf16"  # bf16 | fp16 (with GradScaler) | fp32
    compile: bool = False  # torch.compile the model before wrapping it in DDP
    sync_batchnorm: bool = True  # SyncBatchNorm across ranks (CUDA only; needs world > 1)
    lr: LearningRate = 1e-3  # learning rate tuned for reference_batch_size
    reference_batch_size: PositiveInt = 32  # global batch at which lr was tuned
    lr_scaling: LrScaling = "auto"  # auto: linear for sgd, sqrt for adamw/adafactor, none for optim.name=task
    warmup_fraction: Share = "auto"  # share of steps spent warming up; auto: 1-5%, more for larger batches
    schedule: Schedule = "cosine"  # after warmup: cosine, linear (both to the floor), constant, wsd, step or task
    min_lr_ratio: Ratio = 0.1  # the floor: cosine, linear and wsd decay to lr x min_lr_ratio
    decay_fraction: Ratio = 0.2  # wsd: the share of the steps that decays linearly to the floor, at the end
    milestones: Milestones = field(default_factory=lambda: [0.5, 0.75])  # step: shares of the steps where lr drops
    gamma: Ratio = 0.1  # step: the lr is multiplied by gamma at each milestone
    weight_decay: NonNegative = 0.01  # decoupled weight decay of matrices (norms and biases are never decayed)
    grad_clip: ClipNorm = 1.0  # max global gradient norm (null: no clipping)
    cudnn_benchmark: bool = True  # let cuDNN pick the fastest kernels for fixed input sizes
    eval_every: StepCap = None  # optimizer steps between evaluations (and at the end); null: each epoch's end
    eval_at_start: bool = False  # also evaluate the untrained model at step 0 (a fresh run's baseline)
    eval_limit: StepCap = None  # evaluate the first N eval samples only (the smoke check's quick look); null: all


@dataclass
class OptimConfig:
    name: OptimizerName = "adamw"  # adamw | sgd | adafactor (torch>=2.5) | task: task.build_optimizer
    betas: Betas = field(default_factory=lambda: [0.9, 0.999])  # adamw's decay rates of its two moments
    momentum: Ratio = 0.9  # sgd's momentum
    nesterov: bool = False  # sgd: Nesterov momentum


@dataclass
class FsdpConfig:
    reshard_after_forward: bool = True  # free a unit's gathered weights after forward; false: faster, more memory
    reduce_every_micro_batch: bool = True  # accumulation: sharded gradients between micro-batches; false: whole
    cpu_offload: bool = False  # sharded state in CPU memory (GPU runs): slower, for what does not fit even sharded


@dataclass
class CheckpointConfig:
    every_steps: PositiveInt = 500  # optimizer steps between checkpoints (one is also written at the end)
    keep_last: PositiveInt = 3  # checkpoints kept in out_dir/name/checkpoints/
    resume: str = "auto"  # auto: newest loadable checkpoint of this run; never; or a file path
    allow_new_global_batch: bool = False  # resumed on another world size: rescale the lr instead of keeping the batch
    format: Literal["auto", "full", "sharded"] = "auto"  # auto: sharded under fsdp, full (one file) under ddp
    async_save: bool = False  # sharded: the loop waits for the copy to CPU memory only, the write goes on behind it


@dataclass
class DistConfig:
    timeout_minutes: Minutes = 30.0  # collective timeout; a short one turns a hang into an error
    bucket_cap_mb: PositiveInt = 25  # DDP gradient bucket size
    find_unused_parameters: bool = False  # only if `diagnose unused` lists parameters you need
    static_graph: bool = False  # DDP static_graph: same used parameters every step
    gpus_per_node: PositiveInt = 8  # what this project was planned for; launchers and doctor compare
    num_nodes: PositiveInt = 1  # what this project was planned for


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    @property
    def run_dir(self) -> RunDir:
        return RunDir(Path(self.run.out_dir) / self.run.name)


def load(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- YAML file <- overrides, then validated."""
    return with_overrides(load_tree(path) if path is not None else {}, overrides)


def load_tree(path: str | Path) -> dict:
    """A config file's sections as YAML reads them."""
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror}; pass an existing --config") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(tree).__name__}")
    return tree


def with_overrides(tree: dict, overrides: typing.Sequence[str] = ()) -> Config:
    """A validated Config from a settings tree (a YAML file's, a checkpoint's) and `a.b=value` overrides."""
    for item in overrides:
        key, value = parse_override(item)
        set_path(tree, key, value)
    return from_dict(tree)


def parse_override(item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
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
    return Config(**sections)


def _build_section(name: str, cls: type, values: dict):
    hints = typing.get_type_hints(cls, include_extras=True)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(
                f"{name}.{key}: unknown key; known keys: {', '.join(sorted(known))}: fix its spelling, or, if "
                f"{cls.__name__} changed, `python -m {__package__}.config sync <your config file>` drops its old keys"
            )
    return cls(**{key: _check_type(f"{name}.{key}", value, hints[key]) for key, value in values.items()})


def _check_type(key: str, value, expected):
    if typing.get_origin(expected) is Annotated:
        value = _check_type(key, value, expected.__origin__)
        for rule in expected.__metadata__:
            if isinstance(rule, Rule) and not holds(rule, key, value):
                raise ConfigError(f"{key}: {value!r} is invalid; {rule.fix}")
        return value
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


def holds(rule: Rule, key: str, value) -> bool:
    """Whether `value` keeps the rule; a rule that fails to run is the setting's error, in one line."""
    try:
        return bool(rule.holds(value))
    except Exception as err:
        raise ConfigError(
            f"{key}: its Rule raised {type(err).__name__}: {err} on {value!r}; fix the rule where {key} is declared"
        ) from None


def _describe(expected) -> str:
    if typing.get_origin(expected) is Annotated:
        return _describe(expected.__origin__)
    if typing.get_origin(expected) in (Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(expected))
    if typing.get_origin(expected) is Literal:
        return " or ".join(repr(v) for v in typing.get_args(expected))
    return {
        type(None): "null",
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
    }[expected]


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML; `load(path)` reads it back unchanged."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


HEADER = """\
# Every setting of a run. Override any of them on the command line: section.key=value
# (e.g. `scripts/train.sh optim.lr=3e-4 run.name=lr3e-4`). The resolved config is saved
# to runs/<name>/config.yaml and inside every checkpoint. The keys and comments come from
# the dataclasses (config.py, model.py, data.py): after adding a setting there, run
# `python -m {{ cookiecutter.package_name }}.config sync configs/default.yaml`; values here are kept.
"""
COMMENT_COLUMN = 24


def field_comments(cls: type) -> dict[str, str]:
    """The `# comment` written after each field of a config dataclass, read from its source."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"^\s+(\w+):[^#]*#\s*(.+)$", line)
        if match:
            comments[match.group(1)] = match.group(2).strip()
    return comments


def render_yaml(cfg: Config) -> str:
    """Every setting with its value and the comment from its dataclass: the text of default.yaml."""
    lines = [HEADER.rstrip("\n")]
    for name in typing.get_type_hints(Config):
        section = getattr(cfg, name)
        comments = field_comments(type(section))
        lines += ["", f"{name}:"]
        for f in dataclasses.fields(section):
            head = f"  {f.name}: {_yaml_scalar(getattr(section, f.name))}"
            lines.append(f"{head.ljust(COMMENT_COLUMN - 1)}  # {comments.get(f.name, '')}".rstrip())
    return "\n".join(lines) + "\n"


def _yaml_scalar(value) -> str:
    return yaml.safe_dump([value], default_flow_style=True, width=1000).strip()[1:-1]


def sync(path: str | Path) -> list[str]:
    """Rewrite a config file from the dataclasses, keeping its values; returns what it dropped:
    unknown sections and keys, and values of another type than their setting now has. The new text
    is checked whole, every rule run as load() runs them, before it replaces the file at once: a
    problem is a ConfigError and leaves the file as it was."""
    tree = load_tree(path)
    sections = typing.get_type_hints(Config)
    dropped, kept = [], {}
    for name, values in tree.items():
        if name not in sections or not isinstance(values, dict | None):
            dropped.append(f"{name} (not a section)")
            continue
        hints = typing.get_type_hints(sections[name], include_extras=True)
        kept[name] = {}
        for key, value in (values or {}).items():
            problem = "an unknown key" if key not in hints else type_problem(f"{name}.{key}", value, hints[key])
            if problem:
                dropped.append(f"{name}.{key}={value!r} ({problem})")
            else:
                kept[name][key] = value
    text = render_yaml(from_dict(kept))
    from_dict(yaml.safe_load(text))  # the file as load() will read it
    partial = Path(path).with_name(f".{Path(path).name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
    return dropped


def type_problem(key: str, value, expected) -> str | None:
    """Why `value` is not of the setting's type (its rules aside), or None."""
    base = expected.__origin__ if typing.get_origin(expected) is Annotated else expected
    try:
        _check_type(key, value, base)
    except ConfigError as err:
        return str(err).removeprefix(f"{key}: ")
    return None


def seam_values_off_default(path: str | Path) -> list[str]:
    """The model and dataset values a config file sets away from the dataclass defaults: after a
    swap of model.py or data.py, a value kept under a reused name may belong to the old ones."""
    cfg = load(path)
    found = []
    for name in ("model", "dataset"):
        section = getattr(cfg, name)
        default = type(section)()
        for f in dataclasses.fields(section):
            value, expected = getattr(section, f.name), getattr(default, f.name)
            if value != expected:
                found.append(f"{name}.{f.name}={value!r} (default {expected!r})")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite a config file from the dataclasses, keeping its values.")
    parser.add_argument("command", choices=["sync"])
    parser.add_argument("path", nargs="?", default="configs/default.yaml")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        dropped = sync(args.path)
        kept = seam_values_off_default(args.path)
    print(f"wrote {args.path}" + (f"; dropped {', '.join(dropped)}" if dropped else ""))
    if kept:
        print(f"kept, check they fit your model and data: {', '.join(kept)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
