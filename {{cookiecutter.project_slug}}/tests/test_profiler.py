"""run.profile_steps: a torch.profiler trace of a window of training steps, off by default."""

import json

import pytest
import torch
from conftest import torchrun, train_args

from {{ cookiecutter.package_name }} import config
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop.profiling import profile_window


def info(rank: int) -> DistInfo:
    return DistInfo(rank, rank, 2, 2, torch.device("cpu"), "gloo")


def test_off_by_default_and_only_rank_0_unless_every_rank_is_asked_for(tmp_path):
    assert config.load().run.profile_steps is None
    run_dir = RunDir(tmp_path)
    assert profile_window(None, "main", run_dir, info(0)) is None
    assert profile_window([2, 4], "main", run_dir, info(0)).path == tmp_path / "profile" / "rank0.pt.trace.json"
    assert profile_window([2, 4], "main", run_dir, info(1)) is None
    assert profile_window([2, 4], "all", run_dir, info(1)).path == tmp_path / "profile" / "rank1.pt.trace.json"


@pytest.mark.parametrize("window", ["[5, 3]", "[0, 3]", "[4]", "5", "[1.5, 3]"])
def test_a_bad_window_names_the_key_and_the_fix(window):
    with pytest.raises(ConfigError, match=r"run.profile_steps.*\[start, stop\]|run.profile_steps: .* is not"):
        config.load(None, [f"run.profile_steps={window}"])


@pytest.mark.slow
def test_every_rank_traces_the_window_with_the_training_steps_operators(tmp_path):
    result = torchrun(*train_args(tmp_path, "train.max_steps=12", "run.profile_steps=[4,7]", "run.profile_ranks=all"))
    traces = sorted((tmp_path / "smoke" / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert "profiler trace of steps 5-7" in result.stdout and "rank*.pt.trace.json" in result.stdout
    for trace in traces:
        names = {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}
        assert names & {"aten::addmm", "aten::linear"}  # the model's forward
        assert any(name.startswith("Optimizer.step#AdamW") for name in names)  # the optimizer step
        assert "autograd::engine::evaluate_function: AddmmBackward0" in names  # and its backward
        assert sum(name.startswith("ProfilerStep#") for name in names) >= 2  # step boundaries are marked
