#!/usr/bin/env bash
# Train on every GPU of this node, or on 2 CPU processes where there is none.
#   scripts/train.sh [--config FILE ...] [section.key=value ...]    (default: --config configs/default.yaml)
# Environment: NPROC_PER_NODE (default: visible GPUs, else 2), OMP_NUM_THREADS, MAX_RESTARTS.
# TERM, HUP or USR1: checkpoint at the next log step and exit 75 (rerun or requeue to resume);
# Ctrl-C: the same checkpoint, exit 130; a second signal: stop now.
set -euo pipefail
source "$(dirname "$0")/common.sh"

config_files "$@"
# --standalone picks a free rendezvous port itself: no clash with a job already on 29500.
launch_node --standalone --max-restarts="${MAX_RESTARTS:-0}" -m {{ cookiecutter.package_name }}.train ${CONFIG[@]+"${CONFIG[@]}"} "$@"
