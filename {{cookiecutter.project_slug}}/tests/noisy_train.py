"""The training entry point with a model whose units draw a random number in their forward, as
dropout does, each rank from its own generator: a resume continues bit-identically only if every
rank's generators come back as that rank left them (test_resume.py's NoisyUnits, under torchrun).

    torchrun --standalone --nproc_per_node=2 tests/noisy_train.py --config configs/smoke.yaml ...
"""

from __future__ import annotations

import sys

from test_resume import NoisyUnits

from {{ cookiecutter.package_name }} import task, train

task.build_model = NoisyUnits(task.build_model)

if __name__ == "__main__":
    sys.exit(train.main())
