"""The overhead benchmark in its quick mode, so it cannot rot (figures are not asserted)."""

import re
import subprocess
import sys

import pytest
from conftest import TEMPLATE


@pytest.mark.slow
def test_overhead_benchmark_quick_mode_prints_the_ratio_table():
    result = subprocess.run(
        [sys.executable, str(TEMPLATE / "benchmarks" / "overhead.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("| fp32 |"))
    assert len(re.findall(r"\| \d+\.\d{3} \(\d+\.\d{3}-\d+\.\d{3}\) ", row)) == 2, row  # wall and CPU ratios


def test_every_mutant_of_the_mutation_score_applies_to_the_code_as_baked():
    # each mutant is a text replacement in the baked project: one that no longer matches must fail here
    result = subprocess.run(
        [sys.executable, str(TEMPLATE / "benchmarks" / "mutations.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mutants apply to the baked project" in result.stdout
