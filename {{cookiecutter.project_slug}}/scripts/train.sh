#!/usr/bin/env bash
# Train on every GPU of this node (P29), or on 2 CPU processes where there is none.
#   scripts/train.sh [--config configs/default.yaml] [section.key=value ...]
# Environment: NPROC_PER_NODE (default: visible GPUs, else 2), OMP_NUM_THREADS, MAX_RESTARTS.
set -euo pipefail
source "$(dirname "$0")/common.sh"

NPROC_PER_NODE="${NPROC_PER_NODE:-$(default_nproc_per_node)}"
export_threads_per_process "$NPROC_PER_NODE"

# --standalone picks a free rendezvous port itself: no clash with a job already on 29500.
run_forwarding_signals torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" \
  --max-restarts="${MAX_RESTARTS:-0}" -m {{ cookiecutter.package_name }}.train "$@"
