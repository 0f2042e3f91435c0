"""The same job in Lightning Fabric (model, data, optimizer, precision, accumulation, clipping)."""

import argparse
import time

import torch
import torch.nn.functional as F
from ddp_trainer import config
from ddp_trainer.data import build_datasets
from ddp_trainer.model import build_model
from lightning.fabric import Fabric
from timing import write_timings
from torch.utils.data import DataLoader

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = config.load(args.config, args.overrides)
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy="ddp", precision=PRECISION[cfg.train.precision])
    fabric.launch()
    fabric.seed_everything(cfg.run.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    model, optimizer = fabric.setup(model, optimizer)
    train_set, _ = build_datasets(cfg)
    loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    )
    accum, steps, step, step_times = cfg.train.grad_accum_steps, cfg.train.max_steps, 0, []
    for micro, (inputs, targets) in enumerate(loader):
        last = (micro + 1) % accum == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = F.cross_entropy(model(inputs), targets)
            fabric.backward(loss / accum)
        if not last:
            continue
        fabric.clip_gradients(model, optimizer, max_norm=cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        step_times.append(time.time())
        if step % cfg.run.log_every == 0:
            fabric.print(f"step {step} loss {loss.item():.4f}")
        if step == steps:
            break
    write_timings(step_times)
    fabric.barrier()


if __name__ == "__main__":
    main()
