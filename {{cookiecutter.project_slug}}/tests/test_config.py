import json
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from subprocess import PIPE

import pytest
import torch
from conftest import PACKAGE, PROJECT, SMOKE_CONFIG, Writes, finish, project_env, project_strategy, run, train_args

from {{ cookiecutter.package_name }} import config, train
from {{ cookiecutter.package_name }}.base import rules, typed_config
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rules import ConfigError

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
        for key, comment in typed_config.field_comments(type(getattr(config.Config(), name))).items()
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


@dataclass
class ModelWithABareSetting:
    width: int = 3  # how wide
    depth: int = 2


def test_a_setting_without_a_comment_is_written_without_an_empty_one_and_named_by_sync():
    cfg = replace(config.Config(), model=ModelWithABareSetting())
    lines = config.render_yaml(cfg).splitlines()
    assert "  depth: 2" in lines
    assert any(re.fullmatch(r"  width: 3 +# how wide", line) for line in lines)
    assert config.settings_without_comment(cfg) == ["model.depth"]
    assert config.settings_without_comment() == []  # this project's settings all say what they mean


def test_the_fsdp_tests_follow_the_strategy_the_config_trains_with_in_any_layout(tmp_path):
    # a project that shards runs the FSDP proofs in its fast tier (conftest.runs_fsdp)
    layouts = {
        "parallel:\n  strategy: fsdp\n": "fsdp",
        "train:\n  strategy: fsdp\n": "fsdp",
        "parallel:\n  strategy: ddp\n": "ddp",
        "run:\n  name: a\n": config.Config().parallel.strategy,  # the project's answer
    }
    for text, strategy in layouts.items():
        (tmp_path / "default.yaml").write_text(text)
        assert project_strategy(tmp_path / "default.yaml") == strategy, text


def test_sync_rewrites_a_drifted_file_and_keeps_its_values(tmp_path):
    drifted = tmp_path / "default.yaml"
    drifted.write_text("optim:\n  lr: 0.05  # stale\n  gone: 1\ntrain:\n  grad_clip: tight\ndata:\n  batch_size: 7\n")
    changed = config.sync(drifted)  # an unknown key, and a value of another type than the setting has now
    assert changed == [
        "optim.gone=1 (an unknown key): dropped",
        "train.grad_clip='tight' ('tight' is not a number or null): dropped",
    ]
    assert yaml_comments(drifted.read_text()) == dataclass_comments()
    cfg = config.load(drifted)
    assert cfg.optim.lr == 0.05 and cfg.data.batch_size == 7 and cfg.run == config.RunConfig()


def test_sync_leaves_the_file_as_it_was_when_a_value_breaks_a_rule(tmp_path):
    path = tmp_path / "default.yaml"
    path.write_text("train:\n  lr: -1.0\n")  # of the right type, against its rule: the user's to fix
    with pytest.raises(ConfigError, match=r"optim.lr: -1.0 is invalid; use a positive learning rate") as raised:
        config.sync(path)
    assert str(raised.value).endswith(f"(the value kept from {path}: change it there)")  # where the value is
    assert path.read_text() == "train:\n  lr: -1.0\n"


FUTURE_AND_ANNOTATED = "from __future__ import annotations\n\nfrom typing import Annotated\n"


def test_sync_with_a_rule_that_fails_to_run_is_one_line_exit_2_and_the_file_unchanged(tmp_path):
    # the user's model.py, with a setting whose rule names a constant the module never defined
    source = tmp_path / "src"
    shutil.copytree(PROJECT / "src", source)
    model_py = source / PACKAGE / "model.py"
    broken = '    depth_cap: Annotated[int, Rule(lambda v: v <= MAX_DEPTH, "use at most MAX_DEPTH")] = 1  # cap\n'
    text = re.sub(r"(class ModelConfig:\n)", lambda m: m.group(1) + broken, model_py.read_text(), count=1)
    text = text.replace("from .base.rules import ", "from .base.rules import Rule, ", 1)
    model_py.write_text(text.replace("from __future__ import annotations\n", FUTURE_AND_ANNOTATED, 1))
    path = tmp_path / "default.yaml"
    path.write_bytes(b"model:\n  depth_cap: 2  # mine\n")
    env = project_env(PYTHONPATH=str(source))
    result = run([sys.executable, "-m", f"{PACKAGE}.config", "sync", str(path)], env=env, check=False, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("config error: model.depth_cap: its Rule raised NameError: ")
    assert path.read_bytes() == b"model:\n  depth_cap: 2  # mine\n"


def test_the_dataclass_defaults_are_the_answers_this_project_was_made_with():
    # every file a run reads starts from them: configs/smoke.yaml, the tests' run, names only what it changes
    record = PROJECT / ".cookiecutter.json"
    if not record.exists():
        pytest.skip("no .cookiecutter.json: the answers this project was made with are not recorded")
    answers = json.loads(record.read_text())["cookiecutter"]
    made_with = {
        "train.precision": answers["precision"],
        "data.batch_size": int(answers["per_device_batch_size"]),
        "train.compile": answers["compile"],
        "dist.gpus_per_node": int(answers["gpus_per_node"]),
        "dist.num_nodes": int(answers["num_nodes"]),
    }
    defaults = config.to_dict(config.Config())
    assert {key: defaults[key.split(".")[0]][key.split(".")[1]] for key in made_with} == made_with


def test_the_tests_run_in_fp32_without_compiling_whatever_the_answers():
    # on a CPU: bf16 and fp16 are emulated, several times slower, and some models lack the kernels
    # (oneDNN's bf16 LSTM on CPUs without bf16 units); a test about them names them, as one about
    # fsdp or accumulation names those (the answers are the dataclass defaults)
    tests_run = config.load(SMOKE_CONFIG)
    assert (tests_run.train.precision, tests_run.train.compile) == ("fp32", False)
    assert (tests_run.parallel.strategy, tests_run.train.grad_accum_steps) == ("ddp", 1)


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
        ("model.nosuchkey=1", "model.nosuchkey: unknown key; known keys: "),
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


def test_resolved_config_round_trips_and_names_what_it_was_built_from(tmp_path):
    cfg, sources = config.compose([SMOKE_CONFIG], ["train.precision=fp16", "train.grad_clip=null"])
    config.save(cfg, tmp_path / "resolved.yaml", sources)
    assert config.load(tmp_path / "resolved.yaml") == cfg
    built = f"# settings: {SMOKE_CONFIG} < train.precision=fp16 < train.grad_clip=null\n"
    assert (tmp_path / "resolved.yaml").read_text().startswith(built)


def test_config_files_apply_in_order_and_a_partial_one_changes_only_what_it_names(tmp_path):
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("optim:\n  lr: 0.0005\ntrain:\n  epochs: 4\n")
    base = config.load(DEFAULT_CONFIG)
    cfg, sources = config.compose([DEFAULT_CONFIG, experiment], ["train.epochs=5", "run.name=mine"])
    assert (cfg.optim.lr, cfg.train.epochs, cfg.run.name) == (0.0005, 5, "mine")  # the later file, then overrides
    expected = replace(
        base,
        optim=replace(base.optim, lr=0.0005),
        train=replace(base.train, epochs=5),
        run=replace(base.run, name="mine"),
    )
    assert cfg == expected  # everything else is default.yaml's, not the dataclass defaults
    assert sources.files == (str(DEFAULT_CONFIG), str(experiment))


def test_a_file_that_extends_another_is_read_over_it_relative_to_its_own_folder(tmp_path):
    (tmp_path / "experiments").mkdir()
    base = tmp_path / "configs" / "base.yaml"
    base.parent.mkdir()
    base.write_text("data:\n  batch_size: 12\noptim:\n  lr: 0.25\n")
    experiment = tmp_path / "experiments" / "x.yaml"
    experiment.write_text("extends: ../configs/base.yaml\noptim:\n  lr: 0.5\n")
    cfg, sources = config.compose(experiment)
    assert (cfg.data.batch_size, cfg.optim.lr) == (12, 0.5)
    assert sources.files == (str(base), str(experiment))
    base.write_text("extends: ../experiments/x.yaml\n")
    with pytest.raises(ConfigError, match="`extends` goes round"):
        config.load(experiment)


def files(tmp_path, **texts: str) -> dict:
    """Config files under tmp_path: experiments__x="..." writes experiments/x.yaml."""
    paths = {}
    for name, text in texts.items():
        paths[name] = tmp_path / f"{name.replace('__', '/')}.yaml"
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text(text)
    return paths


def test_a_base_that_extends_names_is_read_once_where_it_first_comes_never_over_later_files(tmp_path, monkeypatch):
    # --config configs/default.yaml --config mine.yaml --config experiments/example.yaml: mine.yaml's
    # values stay where example.yaml does not set them
    paths = files(
        tmp_path,
        configs__base=("data:\n  batch_size: 12\noptim:\n  lr: 0.25\n"),
        mine=("data:\n  batch_size: 64\ntrain:\n  grad_clip: 0.5\noptim:\n  lr: 0.002\n"),
        experiments__x=("extends: ../configs/base.yaml\noptim:\n  lr: 0.5\nschedule:\n"),
    )
    base, mine, experiment = paths["configs__base"], paths["mine"], paths["experiments__x"]
    cfg, sources = config.compose([base, mine, experiment])
    assert (cfg.data.batch_size, cfg.train.grad_clip, cfg.optim.lr) == (64, 0.5, 0.5)
    assert sources.files == (str(base), str(mine), str(experiment))  # each once, in the order applied
    assert sources.describe() == f"settings: {base} < {mine} < {experiment}"
    # at its place: a base first named by the file that extends it is read just before that file
    cfg, sources = config.compose([mine, experiment])
    assert (cfg.data.batch_size, cfg.optim.lr) == (12, 0.5) and sources.files == (str(mine), str(base), str(experiment))

    # paths as typed at a prompt, relative to the working directory: the base is the same file
    monkeypatch.chdir(tmp_path)
    cfg, sources = config.compose(["configs/base.yaml", "mine.yaml", "experiments/x.yaml"])
    assert (cfg.data.batch_size, cfg.optim.lr) == (64, 0.5)
    assert sources.describe() == "settings: configs/base.yaml < mine.yaml < experiments/x.yaml"


def test_an_extends_naming_a_missing_file_says_that_its_target_is_missing_in_which_file(tmp_path):
    experiment = files(tmp_path, experiments__x="extends: ../configs/nope.yaml\n")["experiments__x"]
    with pytest.raises(ConfigError) as raised:
        config.load([DEFAULT_CONFIG, experiment])
    assert str(raised.value) == (
        f"config file {experiment}: its `extends: ../configs/nope.yaml` names {tmp_path / 'configs' / 'nope.yaml'}, "
        f"which is missing; fix the path there (it is read from {experiment.parent})"
    )


def test_every_error_names_the_file_or_the_override_it_came_from(tmp_path):
    paths = files(
        tmp_path, first="optim:\n  lr: 0.5\n", second="optim:\n  lrr: 0.5\n", third="data:\n  batch_size: 0\n"
    )
    with pytest.raises(ConfigError) as raised:
        config.load([paths["first"], paths["second"]])
    assert str(raised.value) == (
        f"optim.lrr: unknown key; did you mean optim.lr? (in {paths['second']}; if OptimConfig changed, "
        f"`python -m {PACKAGE}.config sync {paths['second']}` drops its old keys)"
    )
    with pytest.raises(
        ConfigError, match=re.escape(f"data.batch_size: 0 is invalid; use at least 1 (in {paths['third']})")
    ):
        config.load([paths["first"], paths["third"]])
    with pytest.raises(ConfigError) as raised:
        config.load([paths["first"]], ["run.name=a", "optim.lrr=1"])
    assert str(raised.value) == "optim.lrr: unknown key; did you mean optim.lr? (from the command line's optim.lrr=1)"
    with pytest.raises(
        ConfigError, match=re.escape("-3 is invalid; use at least 1 (from the command line's data.batch_size=-3)")
    ):
        config.load([paths["first"]], ["data.batch_size=-3"])


def test_a_check_blames_the_base_for_a_setting_the_base_gave_not_the_file_that_extends_it(tmp_path):
    paths = files(
        tmp_path,
        configs__base="checkpoint:\n  async_save: true\n  format: full\n",
        experiments__x="extends: ../configs/base.yaml\noptim:\n  lr: 0.5\n",
    )
    cfg, sources = config.compose([SMOKE_CONFIG, paths["experiments__x"]])
    with pytest.raises(ConfigError) as raised:
        train.check_settings(cfg, torch.device("cpu"), sources)
    assert f"checkpoint.async_save=false (in {paths['configs__base']}" in str(raised.value)


def test_a_check_of_the_settings_names_where_the_setting_it_blames_was_given(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("checkpoint:\n  async_save: true\n  format: full\n")
    problem = "checkpoint.async_save: writes sharded checkpoints in the background; set checkpoint.format=sharded"
    cpu = torch.device("cpu")
    for overrides, origin in (([], f"in {mine}"), (["checkpoint.async_save=true"], "from the command line's ")):
        cfg, sources = config.compose([SMOKE_CONFIG, mine], overrides)
        with pytest.raises(ConfigError) as raised:
            train.check_settings(cfg, cpu, sources)
        assert str(raised.value).startswith(problem) and f"checkpoint.async_save=false ({origin}" in str(raised.value)
    cfg, sources = config.compose([SMOKE_CONFIG, mine], preset=["checkpoint.async_save=true"])
    with pytest.raises(ConfigError) as raised:  # a tool's own setting (the smoke check's): no place to name
        train.check_settings(cfg, cpu, sources)
    assert str(raised.value).endswith("or checkpoint.async_save=false")


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("optim.lrr=1", "optim.lrr: unknown key; did you mean optim.lr?"),
        ("optim.nam=sgd", "optim.nam: unknown key; did you mean optim.name?"),  # its own section's first
        ("train.batch_size=8", "train.batch_size: unknown key; did you mean data.batch_size?"),  # the wrong section
        ("optm.lr=1", "optm: unknown section; did you mean optim?"),
        ("optim.zzz=1", "optim.zzz: unknown key; known keys: betas, lr, lr_scaling, momentum, name, nesterov,"),
        # only loosely like a key of another section (train.max_steps): the section's keys, not a wrong guess
        ("optim.warmup_steps=5", "optim.warmup_steps: unknown key; known keys: betas, lr, lr_scaling, momentum,"),
        ("schedule.warmup=0.1", "schedule.warmup: unknown key; did you mean schedule.warmup_fraction?"),  # a prefix
        # a key of another section before a loose one of its own (reference_batch_size)
        ("optim.batch_size=8", "optim.batch_size: unknown key; did you mean data.batch_size?"),
        ("train.name=x", "train.name: unknown key; did you mean run.name, optim.name or schedule.name?"),
    ],
)
def test_an_unknown_name_gets_the_closest_known_one(override, hint):
    with pytest.raises(ConfigError, match=re.escape(hint)):
        config.load(SMOKE_CONFIG, [override])


def test_a_section_named_with_nothing_under_it_changes_nothing(tmp_path):
    paths = files(tmp_path, first="optim:\n  lr: 0.5\n", second="optim:\n")
    assert config.load([paths["first"], paths["second"]]).optim.lr == 0.5


def test_sync_keeps_a_file_that_extends_another_to_the_settings_it_names(tmp_path):
    experiment = tmp_path / "x.yaml"
    experiment.write_text("# my experiment\nextends: default.yaml\noptim:\n  lr: 0.5\n  gone: 1\n")
    assert config.sync(experiment) == ["optim.gone=1 (an unknown key): dropped"]
    assert experiment.read_text() == (
        "# my experiment\nextends: default.yaml\n\noptim:\n"
        f"  lr: 0.5{' ' * 14}  # {typed_config.field_comments(config.OptimConfig)['lr']}\n"
    )


PREVIOUS_LAYOUT = PROJECT / "tests" / "previous_layout.yaml"


def test_a_config_file_of_the_previous_layout_loads_each_old_name_as_the_new_one_with_a_note():
    cfg, sources = config.compose([DEFAULT_CONFIG, PREVIOUS_LAYOUT])
    assert (cfg.train.epochs, cfg.optim.lr, cfg.schedule.name, cfg.schedule.warmup_fraction) == (3, 0.02, "linear", 0)
    assert (cfg.parallel.strategy, cfg.parallel.sync_batchnorm, cfg.eval.every) == ("ddp", False, 7)
    assert (cfg.parallel.reshard_after_forward, cfg.parallel.bucket_cap_mb, cfg.dist.timeout_minutes) == (False, 50, 5)
    note = sources.renamed_note()
    assert note.startswith(f"note: {PREVIOUS_LAYOUT} names settings as they were before their sections were regrouped")
    assert note.endswith(f"`python -m {PACKAGE}.config sync {PREVIOUS_LAYOUT}` rewrites it with the new names")
    assert all(f"{old} -> {config.RENAMED[old]}" in note for old in sources.renamed) and len(sources.renamed) == 8
    old_lr = next(old for old, new in config.RENAMED.items() if new == "optim.lr")
    assert config.load(SMOKE_CONFIG, [f"{old_lr}=0.125"]).optim.lr == 0.125  # an override by its old name too


def test_a_renamed_key_on_the_command_line_is_named_as_such_with_a_fix_for_the_command_line():
    old_lr = next(old for old, new in config.RENAMED.items() if new == "optim.lr")
    cfg, sources = config.compose([DEFAULT_CONFIG], [f"{old_lr}=0.125", "run.name=x"])
    assert cfg.optim.lr == 0.125
    assert sources.renamed_note() == (
        "note: the command line names settings as they were before their sections were regrouped, read as "
        f"{old_lr} -> optim.lr; type optim.lr=0.125 instead"
    )


def test_two_spellings_of_one_setting_on_one_command_line_are_an_error_as_in_a_file():
    with pytest.raises(
        ConfigError, match=r"parallel.strategy=fsdp and train.strategy=ddp on the command line name one"
    ):
        config.load(SMOKE_CONFIG, ["parallel.strategy=fsdp", "train.strategy=ddp"])
    assert config.load(SMOKE_CONFIG, ["optim.lr=0.5", "optim.lr=0.25"]).optim.lr == 0.25  # one spelling: the last


def test_an_old_and_a_new_name_of_one_setting_in_one_file_is_an_error(tmp_path):
    old_lr = next(old for old, new in config.RENAMED.items() if new == "optim.lr").split(".")
    both = tmp_path / "both.yaml"
    both.write_text(f"{old_lr[0]}:\n  {old_lr[1]}: 0.1\noptim:\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=f"name one setting: keep optim.lr, drop {'.'.join(old_lr)} \\(in {both}\\)"):
        config.load(both)


def test_sync_rewrites_a_file_of_the_previous_layout_with_the_new_names(tmp_path):
    shutil.copy(PREVIOUS_LAYOUT, tmp_path / "old.yaml")
    changed = config.sync(tmp_path / "old.yaml")
    assert len(changed) == 8 and all(" -> " in line for line in changed)
    assert config.load(tmp_path / "old.yaml") == config.load(PREVIOUS_LAYOUT)
    assert "\nfsdp:\n" not in (tmp_path / "old.yaml").read_text()


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


# a hang's bound, not a speed check: a rank's start-up to this exit took 3-4 s on 2 quiet cores,
# and 15-30 s at load 10-13 (importing torch, issue 51); a rank that joined its group first would
# wait there for its peer until dist.timeout_minutes (2 in smoke.yaml) and then fail otherwise
RANK_HANG_S = 240


def test_every_rank_fails_on_a_bad_override_before_any_collective(tmp_path):
    # each rank of a world of 2 starts alone, its store on a port of its own: joining the group
    # would wait for a peer that never comes, so exiting with the message shows the check runs
    # before any collective
    def free_port() -> str:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return str(sock.getsockname()[1])

    world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    command = [sys.executable, *train_args(tmp_path, "data.batch_size=-3")]
    ranks = [
        subprocess.Popen(
            command,
            cwd=PROJECT,
            env=project_env(RANK=rank, LOCAL_RANK=rank, MASTER_PORT=free_port(), **world),
            stdout=PIPE,
            stderr=PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in ("0", "1")
    ]  # side by side, as torchrun starts them
    for code, _, stderr in finish(ranks, RANK_HANG_S):
        assert code == 2 and "config error: data.batch_size: -3 is invalid; use at least 1" in stderr, stderr


def previous_layout(settings: dict) -> dict:
    """`settings` (config.to_dict's) as a checkpoint of the previous layout holds them."""
    old = {section: dict(values) for section, values in settings.items()}
    for before, now in config.RENAMED.items():
        (old_section, old_key), (section, key) = before.split("."), now.split(".")
        old.setdefault(old_section, {})[old_key] = old[section].pop(key)
    return {section: values for section, values in old.items() if values}


@pytest.mark.usefixtures("process_settings")
def test_a_checkpoint_of_the_previous_layout_resumes_with_a_note_and_no_setting_changed(tmp_path, capsys):
    overrides = [f"run.out_dir={tmp_path}", "run.tensorboard=false", "data.num_workers=0", "checkpoint.every_steps=4"]
    overrides.append(
        "checkpoint.format=full"
    )  # one file to rewrite as the previous layout wrote it, whatever the strategy
    world_of_one = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
    assert train.run(config.load(SMOKE_CONFIG, [*overrides, "train.max_steps=4"]), world_of_one) == 0
    written = config.load(SMOKE_CONFIG, overrides).run_dir.checkpoint(4)
    payload = torch.load(written, weights_only=True)
    payload["config"] = previous_layout(payload["config"])
    assert "fsdp" in payload["config"] and "parallel" not in payload["config"]
    torch.save(payload, written)
    capsys.readouterr()
    assert train.run(config.load(SMOKE_CONFIG, [*overrides, "train.max_steps=6"]), world_of_one) == 0
    out = capsys.readouterr().out
    assert f"note: {written.name} names settings as they were before their sections were regrouped" in out
    assert "settings changed since it was written: train.max_steps 4 -> 6;" in out  # the one change made
    assert f"resumed from {written} at step 4" in out and "done: 6 steps" in out


@pytest.mark.parametrize("experiment", sorted((PROJECT / "experiments").glob("*.yaml")), ids=lambda path: path.name)
def test_an_experiment_file_changes_only_what_it_names_over_default_yaml(experiment):
    named = typed_config.load_tree(experiment)
    assert named.pop(typed_config.EXTENDS) == "../configs/default.yaml"
    cfg, base = config.to_dict(config.load(experiment)), config.to_dict(config.load(DEFAULT_CONFIG))
    changed = {section: {k: v for k, v in values.items() if base[section][k] != v} for section, values in cfg.items()}
    assert {section: values for section, values in changed.items() if values} == named


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["optim.lr=3e-4"], ["--config", str(DEFAULT_CONFIG)]),
        (["--config", "experiments/example.yaml", "optim.lr=3e-4"], []),
        (["--config=configs/smoke.yaml"], []),
    ],
)
def test_the_scripts_read_default_yaml_unless_the_arguments_name_config_files(arguments, expected):
    shell = 'source scripts/common.sh; config_files "$@"; for arg in ${CONFIG[@]+"${CONFIG[@]}"}; do echo "$arg"; done'
    result = subprocess.run(["bash", "-c", shell, "bash", *arguments], cwd=PROJECT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.splitlines() == expected, result.stderr
