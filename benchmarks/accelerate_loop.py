"""The same job in Hugging Face Accelerate (model, data, optimizer, precision, accumulation, clipping)."""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from ddp_trainer.data import build_datasets
from ddp_trainer.model import build_model
from timing import StepClock, load_settings, write_timings
from torch.utils.data import DataLoader

PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def main():
    cfg = load_settings()
    accelerator = Accelerator(
        cpu=True, mixed_precision=PRECISION[cfg.train.precision], gradient_accumulation_steps=cfg.train.grad_accum_steps
    )
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    train_set, _ = build_datasets(cfg)
    loader = DataLoader(train_set, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    clock = StepClock(cfg, accelerator.print)
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
        if clock.tick(loss):
            break
    write_timings(clock.times)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
