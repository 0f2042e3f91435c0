import re
import shutil
import socket
import subprocess
import sys
from subprocess import PIPE

import pytest
from conftest import PACKAGE, PROJECT, SMOKE_CONFIG, Writes, project_env, run, train_args

from {{ cookiecutter.package_name }} import config, rules, train
from {{ cookiecutter.package_name }}.rules import ConfigError

DEFAULT_CONFIG = PROJECT / "configs" / "default.yaml"


def yaml_comments(text: str) -> dict[str, str]:
    comments, section = {}, None
    for line in text.splitlines():
        if top := re.match(r"^(\w+):", line):
            section = top.group(1)
        elif entry := re.match(r"^\s+(\w+):[^#]*#\s*(.*)$", line):
            comments[f"{section}.{entry.group(1)}"] = entry.group(2).strip()
    return comments


def dataclass_comments() -> dict[str, str]:
    return {
        f"{name}.{key}": comment
        for name, section in config.to_dict(config.Config()).items()
        for key, comment in config.field_comments(type(getattr(config.Config(), name))).items()
    }


def test_default_yaml_holds_every_setting_with_the_comment_of_its_dataclass_field():
    expected = dataclass_comments()
    settings = {f"{name}.{key}" for name, section in config.to_dict(config.Config()).items() for key in section}
    uncommented = sorted(settings - expected.keys())
    assert not uncommented, f"add a `# what it means` comment after the default of {', '.join(uncommented)}"
    assert yaml_comments(DEFAULT_CONFIG.read_text()) == expected, (
        "configs/default.yaml has drifted from the dataclasses: run "
        "`python -m {{ cookiecutter.package_name }}.config sync configs/default.yaml`"
    )


def test_sync_rewrites_a_drifted_file_and_keeps_its_values(tmp_path):
    drifted = tmp_path / "default.yaml"
    drifted.write_text("train:\n  lr: 0.05  # stale comment\n  gone: 1\n  grad_clip: tight\ndata:\n  batch_size: 7\n")
    dropped = config.sync(drifted)  # an unknown key, and a value of another type than the setting has now
    assert dropped == ["train.gone=1 (an unknown key)", "train.grad_clip='tight' ('tight' is not a number or null)"]
    assert yaml_comments(drifted.read_text()) == dataclass_comments()
    cfg = config.load(drifted)
    assert cfg.optim.lr == 0.05 and cfg.data.batch_size == 7 and cfg.run == config.RunConfig()


def test_sync_leaves_the_file_as_it_was_when_a_value_breaks_a_rule(tmp_path):
    path = tmp_path / "default.yaml"
    path.write_text("train:\n  lr: -1.0\n")  # of the right type, against its rule: the user's to fix
    with pytest.raises(ConfigError, match=r"optim.lr: -1.0 is invalid; use a positive learning rate"):
        config.sync(path)
    assert path.read_text() == "train:\n  lr: -1.0\n"


FUTURE_AND_ANNOTATED = "from __future__ import annotations\n\nfrom typing import Annotated\n"


def test_sync_with_a_rule_that_fails_to_run_is_one_line_exit_2_and_the_file_unchanged(tmp_path):
    # the user's model.py, with a setting whose rule names a constant the module never defined
    source = tmp_path / "src"
    shutil.copytree(PROJECT / "src", source)
    model_py = source / PACKAGE / "model.py"
    broken = '    depth_cap: Annotated[int, Rule(lambda v: v <= MAX_DEPTH, "use at most MAX_DEPTH")] = 1  # cap\n'
    text = re.sub(r"(class ModelConfig:\n)", lambda m: m.group(1) + broken, model_py.read_text(), count=1)
    text = text.replace("from .rules import ", "from .rules import Rule, ", 1)
    model_py.write_text(text.replace("from __future__ import annotations\n", FUTURE_AND_ANNOTATED, 1))
    path = tmp_path / "default.yaml"
    path.write_bytes(b"model:\n  depth_cap: 2  # mine\n")
    env = project_env(PYTHONPATH=str(source))
    result = run([sys.executable, "-m", f"{PACKAGE}.config", "sync", str(path)], env=env, check=False, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("config error: model.depth_cap: its Rule raised NameError: ")
    assert path.read_bytes() == b"model:\n  depth_cap: 2  # mine\n"


def test_yaml_then_overrides():
    cfg = config.load(SMOKE_CONFIG, ["optim.lr=3e-4", "data.num_workers=2", "train.max_steps=null", "run.name=x"])
    assert cfg.optim.lr == 3e-4 and cfg.data.num_workers == 2 and cfg.train.max_steps is None
    assert cfg.data.batch_size == 16  # from smoke.yaml
    assert cfg.model == type(cfg.model)()  # dataclass defaults: smoke.yaml has no model section
    assert str(cfg.run_dir).endswith("runs/x")


def test_integers_are_accepted_for_floats():
    assert config.load(None, ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.precision=fp8", "train.precision: 'fp8' is not one of bf16, fp16, fp32"),
        ("train.nosuchkey=1", "train.nosuchkey: unknown key"),
        ("model.nosuchkey=1", "fix its spelling, or, if ModelConfig changed, `python -m"),
        ("nosection.key=1", "nosection: unknown section"),
        ("data.batch_size=-3", "data.batch_size: -3 is invalid; use at least 1"),
        ("data.batch_size=abc", "data.batch_size: 'abc' is not an integer"),
        ("data.num_workers=many", "data.num_workers: 'many' is not an integer or 'auto'"),
        ("train.compile=maybe", "train.compile: 'maybe' is not true/false"),
        ("optim.lr=0", "optim.lr: 0.0 is invalid; use a positive learning rate"),
        ("schedule.warmup_fraction=1.5", "schedule.warmup_fraction: 1.5 is invalid"),
        ("dist.timeout_minutes=0", "dist.timeout_minutes: 0.0 is invalid"),
        ("lr=1", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load(SMOKE_CONFIG, [override])


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)
    with pytest.raises(ConfigError, match="pass an existing --config"):
        config.load(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(SMOKE_CONFIG, ["train.precision=fp16", "train.grad_clip=null"])
    config.save(cfg, tmp_path / "resolved.yaml")
    assert config.load(tmp_path / "resolved.yaml") == cfg


def test_cli_reports_a_bad_override_and_exits_non_zero(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        train.main(train_args(tmp_path, "train.precision=fp8")[2:])  # as `python -m ... train` runs it
    assert exited.value.code == 2
    assert "config error: train.precision: 'fp8' is not one of bf16, fp16, fp32" in capsys.readouterr().err


def test_a_config_error_is_one_write_so_the_ranks_lines_never_run_together(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(SystemExit) as exited, rules.exit_on_user_error():
        raise ConfigError("dataset.root: /x is missing\nmodel.arch: 'resnt' is unknown")
    assert exited.value.code == 2
    assert stderr.calls == ["config error: dataset.root: /x is missing\nconfig error: model.arch: 'resnt' is unknown\n"]


def test_every_rank_fails_on_a_bad_override_before_any_collective(tmp_path):
    # each rank of a world of 2 starts alone: joining the group would wait for the missing
    # peer, so exiting at once with the message shows the check runs before any collective
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    command = [sys.executable, *train_args(tmp_path, "data.batch_size=-3")]
    ranks = [
        subprocess.Popen(command, cwd=PROJECT, env=project_env(RANK=rank, LOCAL_RANK=rank, **world), stderr=PIPE)
        for rank in ("0", "1")
    ]  # side by side, as torchrun starts them
    for rank in ranks:
        _, stderr = rank.communicate(timeout=60)
        assert rank.returncode == 2
        assert "config error: data.batch_size: -3 is invalid; use at least 1" in stderr.decode()
