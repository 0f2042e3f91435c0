"""The same job in Hugging Face Accelerate (model, data, optimizer, precision, accumulation, clipping)."""

import argparse
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from ddp_trainer import config
from ddp_trainer.data import build_datasets
from ddp_trainer.model import build_model
from timing import write_timings
from torch.utils.data import DataLoader

PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = config.load(args.config, args.overrides)
    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=True, mixed_precision=PRECISION[cfg.train.precision], gradient_accumulation_steps=cfg.train.grad_accum_steps
    )
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    train_set, _ = build_datasets(cfg)
    loader = DataLoader(train_set, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, step, step_times = cfg.train.max_steps, 0, []
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not accelerator.sync_gradients:
            continue
        step += 1
        step_times.append(time.time())
        if step % cfg.run.log_every == 0:
            accelerator.print(f"step {step} loss {loss.item():.4f}")
        if step == steps:
            break
    write_timings(step_times)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
