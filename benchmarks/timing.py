"""What every benchmarked loop reports: rank 0's launch time and per-step timestamps."""

import json
import os


def write_timings(step_times: list[float]) -> None:
    if os.environ.get("RANK", "0") == "0":
        with open(os.environ["BENCH_TIMINGS"], "w") as f:
            json.dump({"launch": float(os.environ["BENCH_LAUNCH"]), "step_times": step_times}, f)
