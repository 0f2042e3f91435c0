"""What every benchmarked loop shares: its settings, and how it reports its step times."""

import argparse
import json
import os
import time

import torch
from ddp_trainer import config


def load_settings():
    """The project's config from --config and overrides, as `train.main` reads it; 1 thread."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    return config.load(args.config, args.overrides)


class StepClock:
    """Timestamps each optimizer step, prints the loss every log_every steps, says when to stop."""

    def __init__(self, cfg, print_fn=print):
        self.steps, self.log_every, self.print = cfg.train.max_steps, cfg.run.log_every, print_fn
        self.times = []

    def tick(self, loss) -> bool:
        self.times.append(time.time())
        if len(self.times) % self.log_every == 0:
            self.print(f"step {len(self.times)} loss {loss.item():.4f}")
        return len(self.times) == self.steps


def write_timings(step_times: list[float]) -> None:
    if os.environ.get("RANK", "0") == "0":
        with open(os.environ["BENCH_TIMINGS"], "w") as f:
            json.dump({"launch": float(os.environ["BENCH_LAUNCH"]), "step_times": step_times}, f)
