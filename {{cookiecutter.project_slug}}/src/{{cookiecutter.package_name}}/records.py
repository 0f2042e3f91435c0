"""The records of metrics.jsonl, one JSON object a line, each marked with its kind.

    {"kind": "train", "step": 10, "loss": ..., "lr": ..., "samples_per_s": ..., ...}   a log window
    {"kind": "eval", "step": 10, "eval_loss": ..., "eval_samples": ...}                 an evaluation
    {"kind": "summary", "step": 600, "summary": {...}}                                  the end of an attempt

Every reader asks `kind_of(record)` instead of guessing from the keys a record has.
"""

from __future__ import annotations

import json
from pathlib import Path

TRAIN, EVAL, SUMMARY = "train", "eval", "summary"


def kind_of(record: dict) -> str:
    """The record's kind; files written before records carried one are read by their keys."""
    if "kind" in record:
        return record["kind"]
    return SUMMARY if "summary" in record else EVAL if "eval_samples" in record else TRAIN


def read(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [record for record in records if kind_of(record) == kind]


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
