"""The foundations everything stands on: the process group, the run directory, value rules,
records, the machine's CPUs and GPUs, stop signals and child processes, batches and packed records.
They import nothing of the loop, the seam or the commands."""
