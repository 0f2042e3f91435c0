"""Evaluate a checkpoint on the eval set, as training evaluates: every sample once, sums in float64.

    python -m {{ cookiecutter.package_name }}.tools.evaluate runs/default     # the run's newest loadable checkpoint
    python -m {{ cookiecutter.package_name }}.tools.evaluate runs/default/checkpoints/step_00000500.pt
    torchrun --standalone --nproc_per_node=2 -m {{ cookiecutter.package_name }}.tools.evaluate runs/default

The settings are the checkpoint's own, changed by any `section.key=value` overrides (another
eval set through the dataset settings, say). The model is built and wrapped as training wraps
it, and evaluation's batches do not depend on the world size, so the metrics equal the training run's
evaluation at that step, on any number of ranks. Rank 0 prints them and
writes them as JSON: to RUN_DIR/evaluations/<checkpoint>.json for a run directory, beside the
checkpoint (<checkpoint>.eval.json) for a file, or to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from .. import config, task, train
from ..base import cpus, dist, hardware
from ..base.dist import DistInfo
from ..base.rules import ConfigError, exit_on_user_error
from ..base.rundir import RunDir
from ..config import Config
from ..loop import checkpoint, loaders, metrics


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "target", type=Path, help="a run directory (its newest loadable checkpoint) or a checkpoint file"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. data.batch_size=64")
    parser.add_argument("--out", type=Path, default=None, help="where to write the metrics as JSON")
    return parser.parse_intermixed_args(argv)


def output_of(target: Path, path: Path, chosen: Path | None) -> Path:
    if chosen is not None:
        return chosen
    return RunDir(target).evaluations / f"{path.stem}.json" if target.is_dir() else path.with_suffix(".eval.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    info = DistInfo.from_env()
    with exit_on_user_error():  # before any collective: every rank finds the same problem
        path, payload = checkpoint.find(args.target)
        cfg = config.with_overrides(payload["config"], args.overrides)
        dist.bind_device(info)  # first: a CUDA query from an unbound rank opens a context on GPU 0
        problem = hardware.precision_problem(cfg.train.precision, info.device)
        if problem:
            raise ConfigError(problem)
    out = output_of(args.target, path, args.out)
    work = lambda: evaluate(cfg, info, payload, out, args.overrides)  # noqa: E731
    return dist.run_in_group(info, cfg.dist.timeout_minutes, work)


def evaluate(cfg: Config, info: DistInfo, payload: dict, out: Path, overrides: list[str]) -> int:
    model, (train_set, eval_set) = dist.local_main_first(info, lambda: (task.build_model(cfg), loaders.datasets(cfg)))
    mismatch = checkpoint.model_mismatch(model, payload["model"])
    if mismatch:
        raise ConfigError(f"the checkpoint holds another model than the settings build ({mismatch})")
    model.load_state_dict(payload["model"])
    workers = loaders.resolve_workers(cfg.data, cpus.cpus_available(), info.local_world_size)
    _, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, info, workers)
    reference = loaders.reference_loader(train_set, cfg, info, workers)  # task.reference_set's, if any
    # as training wraps it (device, compile), less SyncBatchNorm: evaluation uses running statistics
    model = train.wrap(model, replace(cfg, parallel=replace(cfg.parallel, sync_batchnorm=False)), info)
    results = train.evaluate(model, eval_loader, cfg, info, reference)
    record = {"step": payload["step"], "epoch": payload["epoch"], **results}
    dist.print0(info, metrics.evaluation_line(record))
    if info.is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record | {"world_size": info.world_size, "overrides": overrides}, indent=2) + "\n")
        print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
