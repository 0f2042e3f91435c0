"""The benchmark scripts in their quick modes, so they cannot rot (figures are not asserted)."""

import re
import subprocess
import sys

import pytest
from conftest import TEMPLATE


def benchmark(script: str, option: str, timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, str(TEMPLATE / "benchmarks" / script), option]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.slow
def test_overhead_benchmark_quick_mode_prints_the_ratio_table():
    result = benchmark("overhead.py", "--quick", timeout=300)
    row = next(line for line in result.stdout.splitlines() if line.startswith("| fp32 |"))
    assert len(re.findall(r"\| \d+\.\d{3} \(\d+\.\d{3}-\d+\.\d{3}\) ", row)) == 2, row  # wall and CPU ratios


def test_every_mutant_of_the_mutation_score_applies_to_the_code_as_baked():
    # each mutant is a text replacement in the baked project: one that no longer matches must fail here
    result = benchmark("mutations.py", "--check", timeout=120)
    assert "mutants apply to the baked project" in result.stdout
