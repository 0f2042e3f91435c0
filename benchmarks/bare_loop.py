"""The shortest correct DDP loop for the same job: the baseline the generated loop must match.

Same model, data, sampler, optimizer, schedule, precision, accumulation and clipping as the
project (it reads the same config file); none of the project's training code.
"""

import argparse
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_trainer import config
from ddp_trainer.data import build_datasets
from ddp_trainer.model import build_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from timing import write_timings
from torch.utils.data import DataLoader, DistributedSampler

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = config.load(args.config, args.overrides)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.run.seed)
    model = DDP(build_model(cfg), bucket_cap_mb=25, gradient_as_bucket_view=True)
    train_set, _ = build_datasets(cfg)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True, seed=cfg.run.seed)
    loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=sampler, drop_last=True)
    accum, steps = cfg.train.grad_accum_steps, cfg.train.max_steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    warmup = max(1, steps // 100)
    scheduler = SequentialLR(optimizer, [LinearLR(optimizer, 1 / (warmup + 1), total_iters=warmup),
                                         CosineAnnealingLR(optimizer, steps - warmup)], milestones=[warmup])
    autocast = torch.autocast("cpu", dtype=DTYPES[cfg.train.precision], enabled=cfg.train.precision != "fp32")
    step_times, step = [], 0
    sampler.set_epoch(0)
    for micro, (inputs, targets) in enumerate(loader):
        last = (micro + 1) % accum == 0
        with nullcontext() if last else model.no_sync():
            with autocast:
                loss = F.cross_entropy(model(inputs), targets)
            (loss / accum).backward()
        if not last:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        step_times.append(time.time())
        if step % cfg.run.log_every == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step == steps:
            break
    write_timings(step_times)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
