#!/usr/bin/env bash
# Train on several nodes (P30): run this script once on every node.
#
# Static master (every node gets the same MASTER_ADDR/MASTER_PORT, its own NODE_RANK):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/train_multinode.sh [overrides...]
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/train_multinode.sh [overrides...]
# Elastic c10d rendezvous (no node ranks; survives restarts):
#   NNODES=2 RDZV_ENDPOINT=10.0.0.1:29622 RDZV_ID=exp1 scripts/train_multinode.sh [overrides...]
#
# Environment: NPROC_PER_NODE, IFNAME (network interface for NCCL/gloo, e.g. eth0 or ib0),
# MAX_RESTARTS (default 3), MASTER_PORT (default 29622, away from the crowded 29500).
set -euo pipefail
source "$(dirname "$0")/common.sh"

: "${NNODES:?set NNODES to the number of nodes}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(default_nproc_per_node)}"
export_threads_per_process "$NPROC_PER_NODE"
if [[ -n "${IFNAME:-}" ]]; then
  export NCCL_SOCKET_IFNAME="$IFNAME" GLOO_SOCKET_IFNAME="$IFNAME"
fi

launcher=(torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" --max-restarts="${MAX_RESTARTS:-3}")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  launcher+=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:?set RDZV_ID, the same on every node}")
else
  : "${NODE_RANK:?set NODE_RANK (0 on the master node) or RDZV_ENDPOINT for c10d rendezvous}"
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
  launcher+=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="${MASTER_PORT:-29622}")
fi
run_forwarding_signals "${launcher[@]}" -m {{ cookiecutter.package_name }}.train "$@"
