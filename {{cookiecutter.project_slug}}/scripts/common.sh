# Shared by the launch scripts. Sourced, not run. Every setting can be overridden from the
# environment; the per-node logic (process count, threads, stopping, exit status) lives in
# src/{{ cookiecutter.package_name }}/tools/launch.py, where it is tested.

# No cd: a relative --config or run.out_dir means what it says where the command was typed.
PROJECT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$PROJECT_ROOT/src${PYTHONPATH:+:$PYTHONPATH}"  # works without `pip install -e .`
export PLANNED_GPUS_PER_NODE={{ cookiecutter.gpus_per_node }}  # the number this project was generated for
if [[ -n "${IFNAME:-}" ]]; then
  export NCCL_SOCKET_IFNAME="$IFNAME" GLOO_SOCKET_IFNAME="$IFNAME"
fi

# The config files to train with: configs/default.yaml, unless the arguments name files of their
# own (which name it, or extend it, where they build on it). Sets CONFIG for "${CONFIG[@]}".
config_files() {
  CONFIG=(--config "$PROJECT_ROOT/configs/default.yaml")
  local arg
  for arg in "$@"; do
    if [[ $arg == --config || $arg == --config=* ]]; then
      CONFIG=()
    fi
  done
}

# torchrun on this node, under the node launcher: one process per visible GPU (NPROC_PER_NODE
# overrides), threads sized to the CPUs, and a stop signal (Ctrl-C, TERM, HUP, USR1) becomes a
# checkpoint on every rank and exit status 75; a second one stops at once.
launch_node() {
  exec python -m {{ cookiecutter.package_name }}.tools.launch "$@"
}
