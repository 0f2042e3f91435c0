#!/usr/bin/env bash
# The multi-GPU acceptance check: a short run of the configured model, data and precision on
# every local GPU (2 CPU processes without GPUs) that verifies DDP is wired correctly and prints
# a PASS/FAIL/SKIP table.
#   scripts/smoke.sh [--config FILE ...] [section.key=value ...]    (default: --config configs/default.yaml)
set -euo pipefail
source "$(dirname "$0")/common.sh"

config_files "$@"
launch_node --standalone -m {{ cookiecutter.package_name }}.tools.smoke ${CONFIG[@]+"${CONFIG[@]}"} "$@"
