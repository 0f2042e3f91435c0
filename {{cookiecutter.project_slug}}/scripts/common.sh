# Shared by the launch scripts: device counting, thread sizing, signal forwarding.
# Sourced, not run. Every setting can be overridden from the environment.

PROJECT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$PROJECT_ROOT"
export PYTHONPATH="$PROJECT_ROOT/src${PYTHONPATH:+:$PYTHONPATH}"  # works without `pip install -e .`
PLANNED_GPUS_PER_NODE={{ cookiecutter.gpus_per_node }}  # the number this project was generated for
PREEMPTED_EXIT_CODE=75  # same as checkpoint.PREEMPTED_EXIT_CODE: the job should be requeued

visible_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
    [[ -z "$CUDA_VISIBLE_DEVICES" ]] && { echo 0; return; }
    echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# One process per GPU; two CPU processes where there is no GPU, so the scripts run anywhere.
default_nproc_per_node() {
  local gpus
  gpus=$(visible_gpus)
  if (( gpus == 0 )); then
    echo 2
    return
  fi
  if (( gpus != PLANNED_GPUS_PER_NODE )); then
    echo "note: $gpus GPUs visible, the project was planned for $PLANNED_GPUS_PER_NODE; using $gpus" >&2
  fi
  echo "$gpus"
}

# torchrun's default of 1 thread per process starves CPU work; the node's CPUs are shared out.
export_threads_per_process() {
  local cpus
  cpus=$(nproc)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cpus / $1 > 0 ? cpus / $1 : 1 ))}"
}

# Run the launcher in the background so a TERM/USR1 (preemption, scancel, SLURM's warning
# signal) is forwarded at once; the workers then checkpoint and stop, and this script exits
# with PREEMPTED_EXIT_CODE so a scheduler knows to requeue.
run_forwarding_signals() {
  local pid interrupted=0
  "$@" &
  pid=$!
  trap 'interrupted=1; kill -TERM "$pid" 2>/dev/null' TERM USR1 INT
  local status=0
  wait "$pid" || status=$?
  while kill -0 "$pid" 2>/dev/null; do  # wait returns early when a trap fires
    wait "$pid" || status=$?
  done
  trap - TERM USR1 INT
  if (( interrupted )); then
    return "$PREEMPTED_EXIT_CODE"
  fi
  return "$status"
}
