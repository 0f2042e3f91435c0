"""The same job in the generated loop, Lightning Fabric and Hugging Face Accelerate.

    python benchmarks/peers.py [--pairs 3]

Installs torch (pinned), lightning and accelerate into benchmarks/.peers-venv (once), bakes a
default project, then runs ours / Fabric / Accelerate interleaved, each with torchrun on 2 CPU
processes of 1 thread, and prints steady-state and start-up ratios against ours. Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from overhead import HERE, bake, launch, summarise

VENV = HERE / ".peers-venv"
PACKAGES = ["torch==2.13.0", "numpy", "pyyaml", "tqdm", "lightning", "accelerate"]
PEERS = ("fabric", "accelerate")


def peers_python() -> str:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    return str(python)


def versions(python: str) -> str:
    code = "import torch, lightning, accelerate as a; print(torch.__version__, lightning.__version__, a.__version__)"
    torch_v, lightning_v, accelerate_v = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return f"torch {torch_v}, lightning {lightning_v}, accelerate {accelerate_v}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=330)
    args = parser.parse_args(argv)
    python, warmup = peers_python(), max(5, args.steps // 10)
    print(versions(python))
    print("| setting | loop | steps/s | steady ratio vs ours | launch->first step | start-up ratio vs ours |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        project = bake(Path(out) / "project")
        for setting in ("fp32", "bf16"):
            runs = {name: [] for name in ("ours", *PEERS)}
            for _ in range(args.pairs):
                for name in runs:
                    record = launch(project, name, [f"train.precision={setting}"], Path(out), args.steps, python)
                    runs[name].append(summarise(record, warmup))
            for name, results in runs.items():
                steady = [r[0] / o[0] for r, o in zip(results, runs["ours"], strict=True)]
                startup = [r[1] / o[1] for r, o in zip(results, runs["ours"], strict=True)]
                print(
                    f"| {setting} | {name} | {statistics.median(r[0] for r in results):.1f} | "
                    f"{statistics.median(steady):.3f} | {statistics.median(r[1] for r in results):.2f} s | "
                    f"{statistics.median(startup):.3f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
