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
