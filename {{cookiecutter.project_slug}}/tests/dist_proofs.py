"""Proofs of the distributed maths, run under torchrun (2 ranks on CPU/gloo in the tests).

    torchrun --standalone --nproc_per_node=2 tests/dist_proofs.py OUT_DIR

Each proof uses the project's own code for the distributed side and a plain single-process
loop, written here by hand, as the reference. Rank 0 writes OUT_DIR/proofs.json; the pytest
tests in test_distributed.py assert on it, one test per practice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from {{ cookiecutter.package_name }} import checkpoint, config, data, dist, optim, train
from {{ cookiecutter.package_name }}.dist import DistInfo
from {{ cookiecutter.package_name }}.model import build_model

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
EXACT_MATHS = ["model.norm=layer", "train.precision=fp32", "train.lr_scaling=none", "data.num_workers=0"]


class SyncCounter:
    syncs = 0
    buckets = 0


def counting_hook(counter: SyncCounter, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counter.buckets += 1
    counter.syncs += bucket.is_last()
    return default_hooks.allreduce_hook(None, bucket)


def single_process_reference(cfg, world_size: int, steps: int) -> torch.nn.Module:
    """What DDP must equal: one process, one batch of world x accum x per-device samples a step."""
    dist.seed_everything(cfg.run.seed)
    model = build_model(cfg)
    train_set, _ = data.build_datasets(cfg)
    global_batch = cfg.data.batch_size * world_size * cfg.train.grad_accum_steps
    optimizer = optim.build_optimizer(model, cfg.train.lr, cfg.train.weight_decay)
    shards = []
    for rank in range(world_size):
        sampler = data.ResumableSampler(
            train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.run.seed, drop_last=True
        )
        sampler.set_epoch(0)
        shards.append(list(sampler))
    per_rank = cfg.data.batch_size * cfg.train.grad_accum_steps
    total = min(cfg.train.max_steps, len(shards[0]) // per_rank)
    scheduler = optim.build_scheduler(
        optimizer,
        cfg.train,
        total,
        optim.warmup_fraction(cfg.train.warmup_fraction, global_batch, cfg.train.reference_batch_size),
    )
    for step in range(steps):
        indices = [i for shard in shards for i in shard[step * per_rank : (step + 1) * per_rank]]
        inputs, targets = train_set.inputs[indices], train_set.targets[indices]
        F.cross_entropy(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return model


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def prove_ddp_equals_big_batch(out: Path, info: DistInfo, accum: int, steps: int) -> dict:
    cfg = config.load(
        SMOKE,
        [
            *EXACT_MATHS,
            f"run.out_dir={out}",
            f"run.name=accum{accum}",
            f"train.grad_accum_steps={accum}",
            f"train.max_steps={steps}",
            "checkpoint.resume=never",
        ],
    )
    job = train.build(cfg, info)
    counter = SyncCounter()
    job.model.register_comm_hook(counter, counting_hook)
    train.fit(job, cfg, info, preemption=checkpoint.PreemptionFlag(signals=()))
    reference = single_process_reference(cfg, info.world_size, steps)
    return {
        "max_difference": max_difference(job.state.model, reference),
        "steps": job.state.step,
        "syncs": counter.syncs,
        "bucket_allreduces": counter.buckets,
        "micro_batches": steps * accum,
    }


def prove_same_initial_weights(info: DistInfo) -> dict:
    cfg = config.load(SMOKE)
    dist.seed_everything(cfg.run.seed)
    first = build_model(cfg).state_dict()["0.weight"]
    gathered = dist.all_gather_objects(first.sum().item())
    return {"checksums": gathered}


def prove_unequal_lengths_fail_on_every_rank(info: DistInfo) -> dict:
    try:
        data.check_equal_lengths(10 + info.rank, info)
    except RuntimeError as err:
        message = str(err)
    else:
        message = ""
    return {"messages": dist.all_gather_objects(message)}


def prove_wrapping(info: DistInfo) -> dict:
    cfg = config.load(SMOKE, ["dist.bucket_cap_mb=7"])
    model, eval_model = train.wrap(build_model(cfg), cfg, info)
    return {
        "is_ddp": isinstance(model, DDP),
        "eval_model_is_unwrapped": not isinstance(eval_model, DDP),
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "find_unused_parameters": model.find_unused_parameters,
        "bucket_bytes_cap": model.bucket_bytes_cap,
    }


def prove_eval_counts(info: DistInfo) -> dict:
    cfg = config.load(SMOKE, ["data.num_workers=0"])
    dist.seed_everything(cfg.run.seed)
    model = build_model(cfg)
    _, eval_loader = data.build_loaders(cfg, info, 0)
    return train.evaluate(model, eval_loader, cfg, info)


def main() -> None:
    out = Path(sys.argv[1])
    which = sys.argv[2:] or ["all"]
    info = DistInfo.from_env()
    dist.init(info, timeout_minutes=1)
    results = {"world_size": info.world_size, "eval": prove_eval_counts(info)}
    if "all" in which:
        results |= {
            "equivalence": prove_ddp_equals_big_batch(out, info, accum=1, steps=12),
            "accumulation": prove_ddp_equals_big_batch(out, info, accum=4, steps=6),
            "initial_weights": prove_same_initial_weights(info),
            "unequal_lengths": prove_unequal_lengths_fail_on_every_rank(info),
            "wrapping": prove_wrapping(info),
        }
    if info.is_main:
        (out / f"proofs-{info.world_size}.json").write_text(json.dumps(results))
    dist.teardown(info)


if __name__ == "__main__":
    main()
