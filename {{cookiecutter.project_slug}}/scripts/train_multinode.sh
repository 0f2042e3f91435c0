#!/usr/bin/env bash
# Train on several nodes: run this script once on every node.
#
# Elastic c10d rendezvous (no node ranks; a failed worker restarts every node's workers):
#   NNODES=2 RDZV_ENDPOINT=10.0.0.1:29622 RDZV_ID=exp1 scripts/train_multinode.sh [overrides...]
# Elastic range: NNODES=1:4 goes on with the nodes left when one is lost (after a restart, the
# rendezvous waits RDZV_CONF=last_call_timeout=<s>, 30 by default, for more) and resumes the newest
# checkpoint on the new world size with the global batch kept.
# Static master (every node gets the same MASTER_ADDR/MASTER_PORT, its own NODE_RANK; no restarts):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/train_multinode.sh [overrides...]
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/train_multinode.sh [overrides...]
#
# runs/ (run.out_dir) must be on a filesystem every node shares: every rank loads the checkpoint.
# Ctrl-C or TERM on any one node: every node checkpoints at the next log step and exits 75
# (the node where Ctrl-C was pressed exits 130: a stop of yours, not a preemption to requeue).
# Environment: NPROC_PER_NODE, IFNAME (network interface for NCCL/gloo, e.g. eth0 or ib0),
# MAX_RESTARTS (c10d: 3; static: 0), MASTER_PORT (default 29622, away from the crowded 29500).
set -euo pipefail
source "$(dirname "$0")/common.sh"

: "${NNODES:?set NNODES to the number of nodes}"
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  rendezvous=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
    --rdzv-id="${RDZV_ID:?set RDZV_ID, the same on every node}" --max-restarts="${MAX_RESTARTS:-3}"
    ${RDZV_CONF:+--rdzv-conf="$RDZV_CONF"})
else
  : "${NODE_RANK:?set NODE_RANK (0 on the master node) or RDZV_ENDPOINT for c10d rendezvous}"
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
  # a static rendezvous cannot tell the nodes that one of them restarted: restarts need c10d
  rendezvous=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --max-restarts="${MAX_RESTARTS:-0}"
    ${MASTER_PORT:+--master-port="$MASTER_PORT"})  # without it the launcher picks its default, 29622
fi
config_files "$@"
launch_node --nnodes="$NNODES" "${rendezvous[@]}" -m {{ cookiecutter.package_name }}.train ${CONFIG[@]+"${CONFIG[@]}"} "$@"
