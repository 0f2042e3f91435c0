"""The same job in Lightning Fabric (model, data, optimizer, precision, accumulation, clipping)."""

import os

import torch
import torch.nn.functional as F
from ddp_trainer.data import build_datasets
from ddp_trainer.model import build_model
from lightning.fabric import Fabric
from timing import StepClock, load_settings, write_timings
from torch.utils.data import DataLoader

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def main():
    cfg = load_settings()
    processes = int(os.environ["LOCAL_WORLD_SIZE"])  # torchrun's; Fabric checks it against devices x nodes
    fabric = Fabric(
        accelerator="cpu",
        devices=processes,
        num_nodes=int(os.environ["WORLD_SIZE"]) // processes,
        strategy="ddp",
        precision=PRECISION[cfg.train.precision],
    )
    fabric.launch()
    fabric.seed_everything(cfg.run.seed)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    model, optimizer = fabric.setup(model, optimizer)
    train_set, _ = build_datasets(cfg)
    loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    )
    accum, clock = cfg.train.grad_accum_steps, StepClock(cfg, fabric.print)
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
        if clock.tick(loss):
            break
    write_timings(clock.times)
    fabric.barrier()


if __name__ == "__main__":
    main()
