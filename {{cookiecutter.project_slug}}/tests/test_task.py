"""The task seam: the default task's contract, and seam mistakes stopped by the preflight."""

import re
import time

import pytest
import torch
from conftest import PROJECT, SMOKE_CONFIG, project_env, read_metrics, torchrun, train_args

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base import batching
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import loaders, preflight
from {{ cookiecutter.package_name }}.loop.preflight import TaskError

FAULTY = str(PROJECT / "tests" / "faulty_train.py")
CPU = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")


@pytest.fixture
def pieces():
    cfg = config.load(SMOKE_CONFIG)
    train_set, eval_set = task.build_datasets(cfg)
    train_loader, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, CPU, 0)
    return task.build_model(cfg), (train_set, train_loader), (eval_set, eval_loader)


def test_sync_names_the_kept_seam_values_that_differ_from_the_defaults(tmp_path):
    kept = tmp_path / "default.yaml"
    kept.write_text("model:\n  hidden: 5\n  depth: 2\ndataset:\n  num_features: 32\n")
    config.sync(kept)
    expected = ["model.hidden=5 (default 64)", "dataset.num_features=32 (default 16)"]
    assert config.seam_values_off_default(kept) == expected


def test_the_default_task_passes_its_own_preflight(pieces):
    model, train, evaluation = pieces
    preflight.check_task(model, train, evaluation)
    assert model.training  # the check ran in eval mode and put the model back


def test_loss_is_a_sum_and_eval_sums_are_per_sample(pieces):
    model, (train_set, train_loader), _ = pieces
    batch = batching.first_samples(train_set, train_loader, 4)
    mean = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    assert torch.allclose(task.loss_sum(model, batch), 4 * mean) and task.count_terms(batch) == 4
    sums = task.eval_sums(model, batch)
    assert {name: tuple(v.shape) for name, v in sums.items()} == {"loss": (4,), "correct": (4,)}
    results = task.metrics({"loss": 2.0, "correct": 3.0, "samples": 4.0})
    assert results == {"loss": 0.5, "accuracy": 0.75} and task.MAIN_METRIC[0] in results


def test_the_synthetic_data_is_learnable_and_deterministic():
    cfg = config.load(SMOKE_CONFIG)
    (a, _), (b, _) = task.build_datasets(cfg), task.build_datasets(cfg)
    assert torch.equal(a.inputs, b.inputs) and len(set(a.targets.tolist())) > 2
    assert (len(a), a.inputs.shape[1]) == (2048, 16)  # test-sized defaults; default.yaml sets a real run's


def test_a_classifier_needs_two_classes():
    with pytest.raises(config.ConfigError, match="dataset.num_classes: 1 is invalid; use at least 2"):
        config.load(None, ["dataset.num_classes=1"])


@pytest.mark.task
def test_the_example_task_trains_to_a_real_result(tmp_path):
    torchrun(*train_args(tmp_path, "run.name=real"), timeout=180)
    evals = [r for r in read_metrics(tmp_path / "real") if "eval_accuracy" in r]
    assert evals[-1]["eval_accuracy"] > 0.7 and evals[-1]["eval_samples"] == 509  # chance is 0.1


def test_a_model_whose_output_does_not_fit_the_loss_is_named(pieces):
    model, train, evaluation = pieces
    wrong = torch.nn.Sequential(model, torch.nn.Unflatten(1, (-1, 1)))
    with pytest.raises(TaskError, match=re.escape("task.loss_sum(model, batch) raised")) as error:
        preflight.check_task(wrong, train, evaluation)
    assert "model output Tensor[2, 10, 1] float32" in str(error.value)
    assert "batch [Tensor[2, 16] float32, Tensor[2] int64]" in str(error.value)


def test_a_loss_that_is_not_a_scalar_is_named(pieces, monkeypatch):
    monkeypatch.setattr(task, "loss_sum", lambda model, batch: model(batch[0]))
    with pytest.raises(TaskError, match=r"returned Tensor\[2, 10\] float32; expected a scalar float tensor"):
        preflight.check_task(*pieces)


def test_eval_sums_must_be_per_sample(pieces, monkeypatch):
    monkeypatch.setattr(task, "eval_sums", lambda model, batch: {"loss": model(batch[0]).sum()})
    with pytest.raises(TaskError, match=r"eval_sums\(model, batch\) returned \{'loss': Tensor\[\] float32\}"):
        preflight.check_task(*pieces)


def test_a_main_metric_that_metrics_does_not_return_is_named(pieces, monkeypatch):
    monkeypatch.setattr(task, "MAIN_METRIC", ("f1", "max"))
    with pytest.raises(TaskError, match="task.MAIN_METRIC is \\('f1', 'max'\\)"):
        preflight.check_task(*pieces)


def test_a_declared_terms_per_sample_that_count_terms_contradicts_is_named(pieces, monkeypatch):
    monkeypatch.setattr(task, "TERMS_PER_SAMPLE", 3)
    with pytest.raises(TaskError, match="count_terms gave 2 terms for 2 samples, but task.TERMS_PER_SAMPLE is 3"):
        preflight.check_task(*pieces)


def test_fixed_terms_per_sample_need_no_collective_and_are_checked_every_step(monkeypatch):
    world = DistInfo(0, 0, 4, 4, torch.device("cpu"), "gloo")
    collectives = []
    monkeypatch.setattr(train.dist, "all_reduce_sum", lambda tensor: collectives.append(tensor) or tensor * 4)
    assert train.step_terms(8.0, 8, world) == 32.0 and not collectives  # 8 terms in this rank's 8 samples
    with pytest.raises(TaskError, match="count_terms gave 9 terms for 8 samples, but task.TERMS_PER_SAMPLE is 1"):
        train.step_terms(9.0, 8, world)
    monkeypatch.setattr(task, "TERMS_PER_SAMPLE", None)  # a varying count: the general path all-reduces it
    assert train.step_terms(8.0, 8, world).item() == 32.0 and len(collectives) == 1


def test_an_empty_dataset_is_named(pieces):
    model, train, (_, eval_loader) = pieces
    with pytest.raises(TaskError, match="the eval set is empty"):
        preflight.check_task(model, train, ([], eval_loader))


@pytest.mark.task
@pytest.mark.parametrize(
    ("mistake", "line"),
    [
        ("wrong_output", "task error: task.loss_sum(model, batch) raised RuntimeError: Expected target size"),
        ("wrong_structure", "task error: task.loss_sum(model, batch) raised"),
        ("bad_label", "task error: task.loss_sum(model, batch) raised IndexError: Target"),
    ],
)
def test_a_seam_mistake_ends_a_two_rank_run_within_seconds_with_one_line_and_exit_2(tmp_path, mistake, line):
    start = time.monotonic()
    result = torchrun(FAULTY, *train_args(tmp_path)[2:], check=False, timeout=60, env=project_env(FAULT=mistake))
    assert time.monotonic() - start < 30
    assert result.returncode != 0
    assert result.stderr.count(line) == 2, result.stderr  # one line from each rank
    assert "preflight.py" not in result.stderr  # the workers print their line, not a traceback
    assert "exitcode  : 2" in result.stderr  # torchrun's failure summary: the worker exited 2
    if mistake == "wrong_structure":
        assert "batch {'sample': [Tensor[2, 16] float32, Tensor[2] int64]}" in result.stderr
