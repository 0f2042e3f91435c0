"""The smoke check against a deliberately broken DDP: gradients are never all-reduced.

    torchrun --standalone --nproc_per_node=2 tests/broken_smoke.py --config configs/smoke.yaml
Used by test_launchers.py to prove that the smoke check catches the breakage (exit 1, FAIL rows).
"""

import sys

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from {{ cookiecutter.package_name }}.tools import smoke


def skip_allreduce(process_group, bucket):
    """Return the local gradients untouched, as if DDP's communication were missing."""
    from torch.futures import Future

    future = Future()
    future.set_result(bucket.buffer())
    return future


default_hooks.allreduce_hook = skip_allreduce

if __name__ == "__main__":
    sys.exit(smoke.main())
