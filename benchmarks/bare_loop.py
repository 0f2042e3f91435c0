"""The shortest correct DDP loop for the same job: the baseline the generated loop must match.

Same model, data, sampler, optimizer, schedule, precision, accumulation and clipping as the
project (it reads the same config file); none of the project's training code.
"""

import gc
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_trainer.data import build_datasets
from ddp_trainer.model import build_model
from timing import load_settings, write_timings
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.utils.data import DataLoader, DistributedSampler

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class BareLoop:
    def __init__(self, cfg):
        torch.manual_seed(cfg.run.seed)
        self.cfg = cfg
        self.model = DDP(build_model(cfg), bucket_cap_mb=25, gradient_as_bucket_view=True)
        train_set, _ = build_datasets(cfg)
        self.sampler = DistributedSampler(train_set, shuffle=True, drop_last=True, seed=cfg.run.seed)
        self.loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=self.sampler, drop_last=True)
        # fused, as the project's; BARE_ADAMW=foreach: torch's default on CPU (the fused row's reference)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            fused=os.environ.get("BARE_ADAMW", "fused") == "fused",
        )
        total = cfg.train.max_steps
        warmup = max(1, total // 100)
        self.scheduler = SequentialLR(
            self.optimizer,
            [LinearLR(self.optimizer, 1 / (warmup + 1), total_iters=warmup), CosineAnnealingLR(self.optimizer, total)],
            milestones=[warmup],
        )
        self.autocast = torch.autocast("cpu", dtype=DTYPES[cfg.train.precision], enabled=cfg.train.precision != "fp32")
        self.step = 0

    def run(self, steps: int, step_times: list | None = None) -> None:
        """`steps` optimizer steps from a fresh pass over the loader."""
        accum, stop = self.cfg.train.grad_accum_steps, self.step + steps
        for micro, (inputs, targets) in enumerate(self.loader):
            last = (micro + 1) % accum == 0
            with nullcontext() if last else self.model.no_sync():
                with self.autocast:
                    loss = F.cross_entropy(self.model(inputs), targets)
                (loss / accum).backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            if step_times is not None:
                step_times.append(time.time())
            if self.step % self.cfg.run.log_every == 0 and dist.get_rank() == 0:
                print(f"step {self.step} loss {loss.item():.4f}", flush=True)
            if self.step == stop:
                return


def main():
    cfg = load_settings()
    import torch._dynamo  # noqa: F401  (DDP imports it; before the group, or it keeps the group alive)

    dist.init_process_group("gloo")
    loop, step_times = BareLoop(cfg), []
    loop.sampler.set_epoch(0)
    loop.run(cfg.train.max_steps, step_times)
    write_timings(step_times)
    dist.barrier()
    del loop  # its DDP model holds the group: free it, and gloo's threads, before Python shuts down
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
