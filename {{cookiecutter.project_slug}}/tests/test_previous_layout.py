"""A checkpoint written before the settings' sections were regrouped, in each format (a full .pt
file, a sharded checkpoint's directory): its settings read in today's layout wherever a command
loads it (checkpoint.load_file), so a run resumes from it and tools.evaluate and tools.export read
it as they read a new one. A sharded checkpoint keeps its settings in the directory's state.pt."""

import json

import pytest
import torch
from conftest import CHECKPOINT_FORMATS, SMOKE_CONFIG, WORLD_OF_ONE, read_metrics
from test_config import previous_layout

from {{ cookiecutter.package_name }} import config, train
from {{ cookiecutter.package_name }}.base import extras, records
from {{ cookiecutter.package_name }}.loop import checkpoint, sharded_checkpoint
from {{ cookiecutter.package_name }}.tools import evaluate, export

pytestmark = pytest.mark.usefixtures("plain_task")  # the loop's own behaviour, whatever the model


def settings_file(written) -> object:
    """The file of checkpoint `written` that holds its settings: the .pt, or a sharded one's state.pt."""
    return written / sharded_checkpoint.STATE_FILE if written.is_dir() else written


def as_previous_layout(written) -> dict:
    """Rewrite checkpoint `written`'s settings (and the settings as given, kept beside them) in the
    previous layout, as that version wrote them; returns its settings in today's layout."""
    path = settings_file(written)
    payload = torch.load(path, weights_only=True)
    today = payload["config"]
    payload["config"] = payload["asked"] = previous_layout(today)
    assert "fsdp" in payload["config"] and "parallel" not in payload["config"]
    torch.save(payload, path)
    return today


@pytest.fixture
def old_checkpoint(tmp_path, process_settings):
    """`old_checkpoint(format)`: a 4-step run's last checkpoint in `format`, rewritten in the previous
    layout; returns (its path, the run's overrides, its settings in today's layout)."""

    def make(fmt: str):
        overrides = [f"run.out_dir={tmp_path}", "run.tensorboard=false", "data.num_workers=0"]
        overrides += ["checkpoint.every_steps=4", f"checkpoint.format={fmt}"]
        assert train.run(config.load(SMOKE_CONFIG, [*overrides, "train.max_steps=4"]), WORLD_OF_ONE) == 0
        written = config.load(SMOKE_CONFIG, overrides).run_dir.checkpoint(4, sharded=fmt == "sharded")
        return written, overrides, as_previous_layout(written)

    return make


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_a_checkpoint_of_the_previous_layout_loads_in_todays_with_its_renames_in_either_format(old_checkpoint, fmt):
    written, _, today = old_checkpoint(fmt)
    _, payload = checkpoint.find(written)
    assert payload["config"] == today and payload["asked"] == today  # the settings as given too
    assert set(payload["renamed_settings"]) == set(config.RENAMED)


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_a_checkpoint_of_the_previous_layout_resumes_noting_a_change_of_a_renamed_setting(old_checkpoint, fmt, capsys):
    written, overrides, today = old_checkpoint(fmt)
    capsys.readouterr()
    lr = today["optim"]["lr"]
    cfg = config.load(SMOKE_CONFIG, [*overrides, "train.max_steps=6", f"optim.lr={2 * lr}"])
    assert train.run(cfg, WORLD_OF_ONE) == 0
    out = capsys.readouterr().out
    assert f"note: {written.name} names settings as they were before their sections were regrouped" in out
    # compared in one layout: the lr, under its new name, is the change the user made
    assert f"settings changed since it was written: train.max_steps 4 -> 6, optim.lr {lr} -> {2 * lr};" in out
    assert f"resumed from {written} at step 4" in out and "done: 6 steps" in out


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_evaluate_and_export_read_a_checkpoint_of_the_previous_layout_in_either_format(old_checkpoint, fmt, capsys):
    written, overrides, today = old_checkpoint(fmt)
    run_dir = config.load(SMOKE_CONFIG, overrides).run_dir
    assert evaluate.main([str(written), "--out", str(run_dir.root / "old.json")]) == 0
    logged = records.of_kind(read_metrics(run_dir.root), records.EVAL)[-1]
    evaluated = json.loads((run_dir.root / "old.json").read_text())
    metrics = [key for key in logged if key.startswith("eval_")]
    assert {key: evaluated[key] for key in metrics} == pytest.approx({key: logged[key] for key in metrics}, rel=1e-6)
    # the export records the digest of the settings in today's layout: the same settings, the same digest
    assert export.main([str(written), str(run_dir.root / "model.safetensors")]) == 0
    metadata = safetensors_metadata(run_dir.root / "model.safetensors")
    assert metadata["config_sha256"] == export.config_digest(today)
    if extras.installed("transformers"):  # the Hugging Face export builds the model from the checkpoint's settings
        capsys.readouterr()
        try:
            code = export.main([str(written), str(run_dir.root / "hf"), "--format", "huggingface"])
        except SystemExit as exited:
            code = exited.code
        err = capsys.readouterr().err
        assert code == 0 or "not a transformers model" in err, err  # built: exported, or refused for its class


def safetensors_metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as opened:
        return opened.metadata()
