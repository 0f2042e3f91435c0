"""Typed configuration: dataclasses <- YAML files, in order <- `section.key=value` overrides.

Every field is documented next to its default, and its value rule sits in its type (see
rules.py). `load()` returns a validated `Config` or raises `ConfigError` with a message that
names the key, the bad value and the fix. The task's own settings live beside the code that
reads them: `ModelConfig` in model.py and `DatasetConfig` in data.py.

Files compose: `--config configs/default.yaml --config experiments/big.yaml optim.lr=3e-4` applies
each file over the ones before it, then the overrides; a file names only what it changes. A file
that starts with `extends: <file>` (a path from its own folder) is read over that file first, so
`--config experiments/big.yaml` alone builds on configs/default.yaml when it says so. Each file is
read once, where it first comes: a base read already is not read again over the files after it.
A run records the files and overrides it was built from (runs/<name>/config.yaml's header, start-up).

    python -m {{ cookiecutter.package_name }}.config sync configs/default.yaml   # rewrite it from the dataclasses
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml

from .base import hardware, optimizers, schedules, typed_config
from .base.rules import ConfigError as ConfigError
from .base.rules import PositiveFloat, PositiveInt, Rule, exit_on_user_error
from .base.rundir import RunDir
from .base.typed_config import EXTENDS, layers, load_tree, merge, parse_override, set_path, type_problem, yaml_scalar
from .data import DatasetConfig
from .model import ModelConfig

Precision = Literal[tuple(hardware.AUTOCAST_DTYPES)]  # bf16, fp16, fp32
LrScaling = Literal["auto", "linear", "sqrt", "none"]
OptimizerName = Literal[(*optimizers.BUILDERS, "task")]  # adamw, sgd, adafactor (base/optimizers.py)
Schedule = Literal[(*schedules.AFTER_WARMUP, "task")]  # cosine, linear, constant, wsd, step (base/schedules.py)
ShardsOrder = Literal["chunks", "shuffle"]
WorkerStart = Literal["auto", "fork", "forkserver", "spawn"]
Strategy = Literal["ddp", "fsdp"]
Checkpointing = Literal["none", "full", "selective"]
TRACKERS = ("wandb", "mlflow")  # tracking.py's services


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
CallbackNames = Annotated[
    list,
    Rule(
        lambda v: all(isinstance(n, str) and n for n in v) and len(set(v)) == len(v),
        "name each once: ema, best_checkpoints, early_stopping or MODULE:CLASS of your callbacks/ folder",
    ),
]
Goal = Literal["auto", "min", "max"]
Decay = Annotated[float, Rule(lambda v: 0 <= v < 1, "use a decay in [0, 1), e.g. 0.999")]
NonNegativeInt = Annotated[int, Rule(lambda v: v >= 0, "use an integer >= 0")]
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
    callbacks: CallbackNames = field(default_factory=list)  # ema, best_checkpoints, early_stopping, MODULE:CLASS


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
    precision: Precision = "bf16"  # bf16 | fp16 (with GradScaler) | fp32
    compile: bool = False  # torch.compile the model before wrapping it in DDP
    grad_clip: ClipNorm = 1.0  # max global gradient norm (null: no clipping)
    cudnn_benchmark: bool = True  # let cuDNN pick the fastest kernels for fixed input sizes


@dataclass
class OptimConfig:
    name: OptimizerName = "adamw"  # adamw | sgd | adafactor (torch>=2.5) | task: task.build_optimizer
    lr: LearningRate = 1e-3  # peak learning rate, tuned at reference_batch_size
    reference_batch_size: PositiveInt = 32  # global batch at which lr was tuned
    lr_scaling: LrScaling = "auto"  # auto: linear for sgd, sqrt for adamw/adafactor, none for optim.name=task
    weight_decay: NonNegative = 0.01  # decoupled weight decay of matrices (norms and biases are never decayed)
    betas: Betas = field(default_factory=lambda: [0.9, 0.999])  # adamw's decay rates of its two moments
    momentum: Ratio = 0.9  # sgd's momentum
    nesterov: bool = False  # sgd: Nesterov momentum


@dataclass
class ScheduleConfig:
    name: Schedule = "cosine"  # after warmup: cosine, linear (both to the floor), constant, wsd, step or task
    warmup_fraction: Share = "auto"  # share of steps spent warming up; auto: 1-5%, more for larger batches; 0: none
    min_lr_ratio: Ratio = 0.1  # the floor: cosine, linear and wsd decay to lr x min_lr_ratio
    decay_fraction: Ratio = 0.2  # wsd: the share of the steps that decays linearly to the floor, at the end
    milestones: Milestones = field(default_factory=lambda: [0.5, 0.75])  # step: shares of the steps where lr drops
    gamma: Ratio = 0.1  # step: the lr is multiplied by gamma at each milestone


@dataclass
class EvalConfig:
    every: StepCap = None  # optimizer steps between evaluations (and at the end); null: each epoch's end
    at_start: bool = False  # also evaluate the untrained model at step 0 (a fresh run's baseline)
    limit: StepCap = None  # evaluate the first N eval samples only (the smoke check's quick look); null: all


@dataclass
class EmaConfig:  # run.callbacks=[ema]: loop/ema.py
    decay: Decay = 0.999  # each step: ema <- decay x ema + (1 - decay) x weights; evaluated as eval/ema/<metric>
    start_step: NonNegativeInt = 0  # up to this step the average is the weights themselves (it skips the first)


@dataclass
class BestCheckpointsConfig:  # run.callbacks=[best_checkpoints]: loop/best_checkpoints.py
    metric: str = "main"  # the evaluation's metric they are ranked by; main: task.MAIN_METRIC; or e.g. ema/loss
    mode: Goal = "auto"  # min or max is better; auto: MAIN_METRIC's for it, min for a loss
    keep: PositiveInt = 3  # checkpoints kept in out_dir/name/checkpoints/best/, beside keep_last's


@dataclass
class EarlyStoppingConfig:  # run.callbacks=[early_stopping]: loop/early_stopping.py
    metric: str = "main"  # the evaluation's metric watched; main: task.MAIN_METRIC; or e.g. loss
    mode: Goal = "auto"  # min or max is better; auto: MAIN_METRIC's for it, min for a loss
    patience: PositiveInt = 3  # evaluations in a row without a better value that end the run
    min_delta: NonNegative = 0.0  # a value better than the best by this much or less is not better


@dataclass
class ParallelConfig:
    strategy: Strategy = "ddp"  # ddp: the whole model on every device; fsdp: sharded over them (torch>=2.8)
    activation_checkpointing: Checkpointing = "none"  # units recomputed in backward: full (all), selective (every 2nd)
    sync_batchnorm: bool = True  # SyncBatchNorm across ranks (CUDA only; needs world > 1)
    bucket_cap_mb: PositiveInt = 25  # ddp: gradient bucket size
    find_unused_parameters: bool = False  # ddp: only if `diagnose unused` lists parameters you need
    static_graph: bool = False  # ddp: static_graph, the same used parameters every step
    reshard_after_forward: bool = True  # fsdp: free gathered weights after forward; false: faster, more memory
    reduce_every_micro_batch: bool = True  # fsdp accumulation: sharded gradients between micro-batches; false: whole
    cpu_offload: bool = False  # fsdp: sharded state in CPU memory (GPU runs); slower, for what does not fit sharded


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
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    best_checkpoints: BestCheckpointsConfig = field(default_factory=BestCheckpointsConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    @property
    def run_dir(self) -> RunDir:
        return RunDir(Path(self.run.out_dir) / self.run.name)


# Settings whose section changed when the sections were regrouped by concern: a config file, an
# override or a checkpoint that names the old key still loads, the key read as the new one.
RENAMED = {
    "train.strategy": "parallel.strategy",
    "train.activation_checkpointing": "parallel.activation_checkpointing",
    "train.sync_batchnorm": "parallel.sync_batchnorm",
    "dist.bucket_cap_mb": "parallel.bucket_cap_mb",
    "dist.find_unused_parameters": "parallel.find_unused_parameters",
    "dist.static_graph": "parallel.static_graph",
    "fsdp.reshard_after_forward": "parallel.reshard_after_forward",
    "fsdp.reduce_every_micro_batch": "parallel.reduce_every_micro_batch",
    "fsdp.cpu_offload": "parallel.cpu_offload",
    "train.lr": "optim.lr",
    "train.reference_batch_size": "optim.reference_batch_size",
    "train.lr_scaling": "optim.lr_scaling",
    "train.weight_decay": "optim.weight_decay",
    "train.schedule": "schedule.name",
    "train.warmup_fraction": "schedule.warmup_fraction",
    "train.min_lr_ratio": "schedule.min_lr_ratio",
    "train.decay_fraction": "schedule.decay_fraction",
    "train.milestones": "schedule.milestones",
    "train.gamma": "schedule.gamma",
    "train.eval_every": "eval.every",
    "train.eval_at_start": "eval.at_start",
    "train.eval_limit": "eval.limit",
}


@dataclass(frozen=True)
class Sources:
    """What a config was built from: files in the order applied (each once), overrides, the renamed
    keys read (their old names) and, for each, where it was read: a file, or an override as typed."""

    files: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    renamed: tuple[str, ...] = ()
    renamed_in: tuple[str, ...] = ()  # beside `renamed`: the file or the override that named each
    origins: tuple[tuple[str, str], ...] = ()  # (setting, "in FILE", "from the command line's a.b=c" or "" for a
    # tool's own), the last of a setting the one that holds

    def located(self, err: ConfigError) -> ConfigError:
        """A check's error about the setting it starts with ("train.precision: ..."), saying where
        that setting was given; unchanged for a default."""
        origin = dict(self.origins).get(str(err).split(":", 1)[0])
        return typed_config.located(err, origin) if origin else err

    def describe(self) -> str:
        parts = [*self.files, *self.overrides] or ["the dataclass defaults"]
        return "settings: " + " < ".join(parts)

    def renamed_note(self) -> str | None:
        """A line for the renamed keys the files named, one for the command line's, or None."""
        where = self.renamed_in or ("",) * len(self.renamed)  # not told where: the files
        typed = [item for item in where if item in self.overrides]
        in_files = [old for old, item in zip(self.renamed, where, strict=True) if item not in self.overrides]
        paths = list(dict.fromkeys(item for item in where if item and item not in self.overrides))
        one = paths[0] if len(paths) == 1 else None
        sync = f"`python -m {__package__}.config sync {one or 'FILE'}` rewrites {'it' if one else 'a file'}"
        notes = [
            renamed_note(in_files, one or "the config", f"{sync} with the new names"),
            renamed_note(
                [parse_override(item)[0] for item in typed],
                "the command line",
                f"type {' '.join(with_new_name(item) for item in typed)} instead",
            ),
        ]
        return "\n".join(note for note in notes if note) or None


def with_new_name(override: str) -> str:
    """An override of a renamed key, as typed under its new name."""
    key, _, value = override.partition("=")
    return f"{RENAMED.get(key.strip(), key.strip())}={value}"


def renamed_note(renamed, where: str, fix: str) -> str | None:
    """One line naming the renamed keys `where` used, and what to do about them, or None."""
    if not renamed:
        return None
    names = ", ".join(f"{old} -> {RENAMED[old]}" for old in dict.fromkeys(renamed))
    return f"note: {where} names settings as they were before their sections were regrouped, read as {names}; {fix}"


def load(paths: str | Path | typing.Sequence | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults <- each YAML file in order <- overrides, then validated."""
    return compose(paths, overrides)[0]


def compose(
    paths: str | Path | typing.Sequence | None, overrides: typing.Sequence[str] = (), preset: typing.Sequence[str] = ()
) -> tuple[Config, Sources]:
    """`load`, and what the config was built from. Each file is read once, where it first comes:
    a base that an `extends` names and that was read already (given before, or the base of a file
    before) is not read again over the files after it. Each file and each override is checked on
    its own, so an error names the file or the override it came from. `preset`: a tool's own
    overrides (the smoke check's), applied before `overrides` and not listed as the user's."""
    files = [paths] if isinstance(paths, (str, Path)) else list(paths or [])
    tree, read, renamed, renamed_in, applied, origins = {}, [], [], [], set(), []
    for path in files:
        for layer_path, layer in layers(Path(path)):
            if layer_path.resolve() in applied:
                continue
            applied.add(layer_path.resolve())
            try:
                layer, old = upgrade(layer)
                typed_config.check_tree(Config, layer)
            except ConfigError as err:
                raise typed_config.located(err, f"in {layer_path}", str(layer_path)) from None
            merge(tree, layer)
            origins += [
                (f"{section}.{key}", f"in {layer_path}") for section, keys in layer.items() for key in keys or {}
            ]
            read.append(str(layer_path))
            renamed += old
            renamed_in += [str(layer_path)] * len(old)
    typed: list[str] = []
    cfg = with_overrides(tree, [*preset, *overrides], typed)
    for item in [*preset, *overrides]:  # valid here: with_overrides checked each
        key = parse_override(item)[0]
        origins.append((RENAMED.get(key, key), f"from the command line's {item}" if item in overrides else ""))
    renamed += [parse_override(item)[0] for item in typed]
    return cfg, Sources(tuple(read), tuple(overrides), tuple(renamed), (*renamed_in, *typed), tuple(origins))


def upgrade(tree: dict) -> tuple[dict, list[str]]:
    """`tree` (a config file's or a checkpoint's settings) with each key of RENAMED under its new
    name, and the old names it held."""
    return typed_config.upgrade(tree, RENAMED, typing.get_type_hints(Config))


def with_overrides(tree: dict, overrides: typing.Sequence[str] = (), renamed: list | None = None) -> Config:
    """A validated Config from a settings tree (files', a checkpoint's) and `a.b=value` overrides,
    each checked on its own; an override of a renamed key sets its new name (and is listed in
    `renamed`, as typed). One setting named under both its names is an error, as in a file."""
    named: dict[str, str] = {}  # the setting -> the override that set it
    for item in overrides:
        key, value = parse_override(item)
        setting = RENAMED.get(key, key)
        earlier = named.get(setting)
        if earlier is not None and parse_override(earlier)[0] != key:
            raise ConfigError(f"{earlier} and {item} on the command line name one setting: keep one, as {setting}=...")
        named[setting] = item
        alone: dict = {}
        try:
            set_path(alone, setting, value)
            typed_config.check_tree(Config, alone)
        except ConfigError as err:
            raise typed_config.located(err, f"from the command line's {item}") from None
        if setting != key and renamed is not None:
            renamed.append(item)
        set_path(tree, setting, value)
    return from_dict(tree)


def add_config_option(parser, what: str = "the run's settings") -> None:
    """`--config FILE`, as many as wanted, applied in order (default: configs/default.yaml)."""
    parser.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        help=f"YAML file with {what}; repeat to apply files in order (default: {DEFAULT_FILE})",
    )


def files(chosen: list[str] | None) -> list[str]:
    """The --config files given, or configs/default.yaml."""
    return chosen or [DEFAULT_FILE]


DEFAULT_FILE = "configs/default.yaml"


def from_dict(tree: dict) -> Config:
    """A validated Config from a tree of sections: each value checked against its type and rules."""
    return typed_config.build(Config, tree)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save(cfg: Config, path: str | Path, sources: Sources | None = None) -> None:
    """Write the resolved config as YAML, headed by what it was built from; `load(path)` reads it
    back unchanged."""
    built = f"# {sources.describe()}\n" if sources else ""
    Path(path).write_text(built + yaml.safe_dump(to_dict(cfg), sort_keys=False))


HEADER = """\
# Every setting of a run. Override any of them on the command line: section.key=value
# (e.g. `scripts/train.sh optim.lr=3e-4 run.name=lr3e-4`), or in a file of your own passed after
# this one (`--config configs/default.yaml --config experiments/mine.yaml`), which names only what
# it changes. The resolved config is saved to runs/<name>/config.yaml and inside every checkpoint.
# The keys and comments come from the dataclasses (config.py, model.py, data.py): after adding a
# setting there, run `python -m {{ cookiecutter.package_name }}.config sync configs/default.yaml`;
# the values here are kept.
"""


def render_yaml(cfg: Config, only: dict | None = None, head: str = HEADER) -> str:
    """Settings with their values and the comments of their dataclass fields, under `head`: every
    setting (the text of default.yaml), or those `only` names (an experiment file's)."""
    return typed_config.render(cfg, head, only)


def sync(path: str | Path) -> list[str]:
    """Rewrite a config file from the dataclasses, keeping its values; returns what changed: each
    renamed key (old -> new), each unknown section or key and each value of another type than its
    setting now has (dropped). A file that `extends` another keeps naming only what it sets; any
    other gets every setting. The new text is checked whole, every rule run as load() runs them,
    before it replaces the file at once: a problem is a ConfigError and leaves the file as it was."""
    raw = load_tree(path)
    base = raw.pop(EXTENDS, None)
    tree, moved = upgrade(raw)
    sections = typing.get_type_hints(Config)
    changed, kept = [f"{old} -> {RENAMED[old]}" for old in moved], {}
    for name, values in tree.items():
        if name not in sections or not isinstance(values, dict | None):
            changed.append(f"{name} (not a section): dropped")
            continue
        hints = typing.get_type_hints(sections[name], include_extras=True)
        kept[name] = {}
        for key, value in (values or {}).items():
            problem = "an unknown key" if key not in hints else type_problem(f"{name}.{key}", value, hints[key])
            if problem:
                changed.append(f"{name}.{key}={value!r} ({problem}): dropped")
            else:
                kept[name][key] = value
    try:
        if base is None:
            text = render_yaml(from_dict(kept))
        else:
            comments = "".join(line + "\n" for line in Path(path).read_text().splitlines() if line.startswith("#"))
            text = render_yaml(from_dict(kept), kept, comments + f"{EXTENDS}: {yaml_scalar(base)}\n")
        checked = yaml.safe_load(text)
        checked.pop(EXTENDS, None)
        from_dict(checked)  # the file as load() will read it
    except ConfigError as err:  # a value the file holds, against a rule that changed since (a new model's range)
        raise typed_config.located(err, f"the value kept from {path}: change it there") from None
    partial = Path(path).with_name(f".{Path(path).name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
    return changed


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


def settings_without_comment(cfg: Config | None = None) -> list[str]:
    """The settings whose dataclass field has no `# what it means` after its default: default.yaml
    shows that comment, and a test of the suite asks for one."""
    cfg = cfg or Config()
    return [
        f"{name}.{f.name}"
        for name in typing.get_type_hints(type(cfg))
        for f in dataclasses.fields(getattr(cfg, name))
        if f.name not in typed_config.field_comments(type(getattr(cfg, name)))
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite a config file from the dataclasses, keeping its values.")
    parser.add_argument("command", choices=["sync"])
    parser.add_argument("path", nargs="?", default=DEFAULT_FILE)
    args = parser.parse_args(argv)
    with exit_on_user_error():
        changed = sync(args.path)
        kept = seam_values_off_default(args.path)
    print(f"wrote {args.path}" + (f"; {', '.join(changed)}" if changed else ""))
    if kept:
        print(f"kept, check they fit your model and data: {', '.join(kept)}")
    if bare := settings_without_comment():
        print(f"no comment yet, write `# what it means` after its default in the dataclass: {', '.join(bare)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
