"""The records of metrics.jsonl, one JSON object a line, each marked with its kind, and the one
mapping from a record to the scalars every sink shows (TensorBoard, W&B, MLflow).

    {"kind": "train", "step": 10, "loss": ..., "lr": ..., "samples_per_s": ..., ...}   a log window
    {"kind": "eval", "step": 10, "eval_loss": ..., "eval_samples": ...}                 an evaluation
                                         (a callback's model's beside it: "eval_ema/loss": ...)
    {"kind": "summary", "step": 600, "summary": {...}}                                  the end of an attempt
"""

from __future__ import annotations

import json
from pathlib import Path

TRAIN, EVAL, SUMMARY = "train", "eval", "summary"
EVAL_PREFIX = "eval_"  # an evaluation's metrics sit beside its step, so they carry a prefix
EVAL_SAMPLES = "eval_samples"
POSITION = ("kind", "step", "start_step", "world_size")  # when and where a record was made: not scalars


def read(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [record for record in records if record["kind"] == kind]


def evaluation(metrics: dict[str, float], samples: int) -> dict:
    """An evaluation's fields as metrics.jsonl holds them: eval_<metric> for each metric, eval_samples."""
    return {EVAL_PREFIX + name: value for name, value in metrics.items()} | {EVAL_SAMPLES: samples}


def prefixed(evaluation: dict, prefix: str) -> dict:
    """Another model's evaluation (a callback's, such as EMA's) beside the model's: each metric
    eval_<prefix>/<metric>, its samples left out (the same set)."""
    return {
        f"{EVAL_PREFIX}{prefix}/{key.removeprefix(EVAL_PREFIX)}": value
        for key, value in evaluation.items()
        if key != EVAL_SAMPLES
    }


def eval_metrics(record: dict) -> dict[str, float]:
    """An evaluation's metrics by their task's names (task.metrics)."""
    return {
        key.removeprefix(EVAL_PREFIX): value
        for key, value in record.items()
        if key.startswith(EVAL_PREFIX) and key != EVAL_SAMPLES
    }


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a train or eval record by the tag every sink shows them under: train/loss,
    train/lr, train/tokens_per_s, train/mfu, time/fwd_bwd_ms, eval/accuracy, ..."""
    if record["kind"] == EVAL:
        return {f"eval/{name}": float(value) for name, value in eval_metrics(record).items()}
    if record["kind"] != TRAIN:
        return {}
    numbers = {
        key: float(value)
        for key, value in record.items()
        if key not in POSITION and isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    return {(f"time/{key}" if key.endswith("_ms") else f"train/{key}"): value for key, value in numbers.items()}


def best_and_final(evals: list[dict], main_metric: tuple[str, str]) -> tuple[dict, dict] | None:
    """The best evaluation by the task's main metric ("max" or "min" is better) and the last one;
    None without an evaluation of it."""
    name, goal = main_metric
    scored = [record for record in evals if EVAL_PREFIX + name in record]
    if not scored:
        return None
    best = (max if goal == "max" else min)(scored, key=lambda record: record[EVAL_PREFIX + name])
    return best, scored[-1]


def current_timeline(logged: list[dict]) -> list[dict]:
    """The records of the run as it went on: when an attempt resumed from a checkpoint at step S,
    what earlier attempts had logged after S was superseded, as TensorBoard purges it."""
    kept: list[dict] = []
    attempt = (None, float("inf"))  # (start_step, elapsed_s) of the latest log window
    for record in logged:
        if "start_step" in record:
            if record["start_step"] != attempt[0] or record["elapsed_s"] < attempt[1]:  # a new attempt
                kept = [r for r in kept if r["step"] <= record["start_step"]]
            attempt = (record["start_step"], record["elapsed_s"])
        kept.append(record)
    return kept


def latest_per_step(logged: list[dict]) -> list[dict]:
    """One record per step, in step order; where a step was logged twice, the later record wins."""
    return sorted({r["step"]: r for r in logged}.values(), key=lambda r: r["step"])
