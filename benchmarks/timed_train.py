"""The generated project's own entry point, with a timestamp taken after every optimizer step."""

import sys
import time

from ddp_trainer import train
from timing import write_timings

step_times = []
untimed_step = train.optimizer_step


def timed_step(model, state, cfg):
    untimed_step(model, state, cfg)
    step_times.append(time.time())


train.optimizer_step = timed_step

if __name__ == "__main__":
    code = train.main()
    write_timings(step_times)
    sys.exit(code)
