"""TensorBoard: the scalars a run writes (the ones every sink shows), read back from its event files,
and resumes without repeats."""

import sys

import pytest
from conftest import WORLD_OF_ONE, read_metrics, run, torchrun, train_args

from {{ cookiecutter.package_name }} import task
from {{ cookiecutter.package_name }}.base import records
from {{ cookiecutter.package_name }}.base.rules import ConfigError
from {{ cookiecutter.package_name }}.base.rundir import RunDir

pytest.importorskip("tensorboard", reason="TensorBoard is optional: pip install tensorboard (the viz extra)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from {{ cookiecutter.package_name }}.loop import tensorboard as board  # noqa: E402  (after the skip)


def scalars(log_dir) -> dict[str, list]:
    """tag -> [(step, value)], as TensorBoard shows them (purged events left out)."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_records_become_the_scalars_every_sink_shows():
    window = {"kind": "train", "step": 5, "epoch": 0, "loss": 2.0, "lr": 0.1, "tokens_per_s": 9.0, "mfu": 0.3}
    window |= {"fwd_bwd_ms": 3.0, "world_size": 2, "start_step": 0}
    assert records.scalars(window) == {
        "train/epoch": 0.0,
        "train/loss": 2.0,
        "train/lr": 0.1,
        "train/tokens_per_s": 9.0,
        "train/mfu": 0.3,
        "time/fwd_bwd_ms": 3.0,
    }
    evaluation = {"kind": "eval", "step": 5, "epoch": 0, "eval_loss": 1.5, "eval_f1": 0.7, "eval_samples": 509}
    assert records.scalars(evaluation) == {"eval/loss": 1.5, "eval/f1": 0.7}
    assert records.scalars({"kind": "summary", "step": 5, "summary": {"wall_s": 1.0}}) == {}


def test_a_resumed_writer_hides_what_the_interrupted_one_logged_past_the_checkpoint(tmp_path):
    first = board.Board(RunDir(tmp_path), first_step=0)
    for step in range(5, 35, 5):  # logged up to step 30; the last checkpoint was at step 20
        first.write({"kind": "train", "step": step, "loss": 1.0})
    first.close()
    resumed = board.Board(RunDir(tmp_path), first_step=20)
    for step in range(25, 45, 5):
        resumed.write({"kind": "train", "step": step, "loss": 2.0})
    resumed.close()
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [
        (5, 1.0),
        (10, 1.0),
        (15, 1.0),
        (20, 1.0),
        (25, 2.0),
        (30, 2.0),
        (35, 2.0),
        (40, 2.0),
    ]


def test_auto_without_tensorboard_notes_it_and_true_is_a_config_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(board.extras, "installed", lambda package: package != "tensorboard")
    assert board.open_board("auto", RunDir(tmp_path), 0, WORLD_OF_ONE) is None
    assert "pip install -e '.[viz]'" in capsys.readouterr().out
    with pytest.raises(
        ConfigError, match=r"run.tensorboard=true needs tensorboard, which is not installed: pip install"
    ):
        board.check(True)
    board.check("auto"), board.check(False)  # no error
    assert board.open_board(False, RunDir(tmp_path), 0, WORLD_OF_ONE) is None and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_two_rank_run_resumed_mid_way_logs_every_step_once_in_order(tmp_path):
    """Rank 0 alone writes; a resume from step 20 after steps up to 30 were logged leaves one
    event per step, in order, each equal to the run's final metrics.jsonl record for that step."""
    overrides = ("run.log_every=5", "checkpoint.every_steps=20", "run.tensorboard=true")
    torchrun(*train_args(tmp_path, *overrides, "train.max_steps=30"))
    checkpoints = sorted((tmp_path / "smoke" / "checkpoints").glob("step_*.pt"))
    resume_from = next(c for c in checkpoints if c.name.endswith("20.pt"))
    torchrun(*train_args(tmp_path, *overrides, "train.max_steps=40", f"checkpoint.resume={resume_from}"))

    events = scalars(tmp_path / "smoke" / "tensorboard")
    assert len(list((tmp_path / "smoke").glob("**/*tfevents*"))) == 2  # one file per attempt, from rank 0 only
    steps = [step for step, _ in events["train/loss"]]
    assert steps == list(range(5, 45, 5))  # once each, in order, although 25 and 30 ran twice
    final = {r["step"]: r for r in read_metrics(tmp_path / "smoke") if "loss" in r}  # the later record wins
    assert [value for _, value in events["train/loss"]] == pytest.approx([final[s]["loss"] for s in steps], rel=1e-6)
    for tag in ("train/lr", "train/samples_per_s", "train/data_wait_share", "time/fwd_bwd_ms", "time/optimizer_ms"):
        assert [step for step, _ in events[tag]] == steps, tag
    main_metric = f"eval/{task.MAIN_METRIC[0]}"
    assert [step for step, _ in events[main_metric]] == [40]  # the eval at 30 belonged to the superseded attempt
    assert {"eval/loss", "time/data_wait_ms", "time/other_ms", "time/step_ms"} <= set(events)


@pytest.mark.slow
def test_evaluations_within_an_epoch_and_the_baseline_become_eval_events(tmp_path):
    overrides = ("eval.every=10", "eval.at_start=true", "train.max_steps=30", "run.tensorboard=true")
    torchrun(*train_args(tmp_path, *overrides))
    events = scalars(tmp_path / "smoke" / "tensorboard")
    assert [step for step, _ in events[f"eval/{task.MAIN_METRIC[0]}"]] == [0, 10, 20, 30]


@pytest.mark.slow
def test_tensorboard_false_writes_no_event_files(tmp_path):
    run([sys.executable, *train_args(tmp_path, "train.max_steps=10", "run.tensorboard=false")])
    assert not (tmp_path / "smoke" / "tensorboard").exists()
