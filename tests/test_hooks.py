"""The hooks' functions, imported and tested directly."""

import json
import subprocess

import jinja2
import pytest
import yaml
from conftest import TEMPLATE, load_hook

pre = load_hook("pre_gen_project")
post = load_hook("post_gen_project")

DEFAULTS = {
    "project_name": "DDP Trainer",
    "project_slug": "ddp-trainer",
    "package_name": "ddp_trainer",
    "description": "Distributed data-parallel training with PyTorch DDP.",
    "author": "Your Name",
    "task": "classifier",
    "gpus_per_node": "8",
    "num_nodes": "1",
    "precision": "bf16",
    "sync_batchnorm": True,
    "compile": False,
    "strategy": "ddp",
    "grad_accum_steps": "1",
    "per_device_batch_size": "32",
    "slurm": True,
    "kubernetes": False,
    "tracker": "tensorboard",
    "license": "MIT",
}


def answers(**changes):
    return DEFAULTS | changes


def test_defaults_are_valid():
    assert pre.validate(answers()) == ([], [])


@pytest.mark.parametrize("slug", ["ddp-trainer", "my_net2", "a"])
def test_good_slugs(slug):
    assert pre.check_slug(slug) is None


@pytest.mark.parametrize(("slug", "suggestion"), [("My-Project!", "my-project"), ("2fast", "fast"), ("", "my-project")])
def test_bad_slugs_suggest_a_fix(slug, suggestion):
    assert f"(e.g. '{suggestion}')" in pre.check_slug(slug)


@pytest.mark.parametrize("name", ["torch", "test", "tests", "os", "json", "class", "yaml", "numpy"])
def test_reserved_package_names(name):
    assert "would shadow" in pre.check_package(name)


@pytest.mark.parametrize("name", ["My_Pkg", "my-pkg", "1pkg", "pkg!"])
def test_package_must_be_a_lowercase_identifier(name):
    assert "not a lowercase Python identifier" in pre.check_package(name)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("gpus_per_node", "0", "gpus_per_node 0 is out of range: use 1 to 64"),
        ("gpus_per_node", "65", "out of range"),
        ("num_nodes", "-1", "num_nodes '-1' is not a whole number"),
        ("grad_accum_steps", "x", "grad_accum_steps 'x' is not a whole number: type e.g. grad_accum_steps=1"),
        ("per_device_batch_size", "1.5", "not a whole number"),
    ],
)
def test_counts_are_checked(key, value, message):
    errors, _ = pre.validate(answers(**{key: value}))
    assert len(errors) == 1 and message in errors[0]


def test_fsdp_with_fp16_is_refused_at_bake_time_and_fsdp_writes_its_strategy_and_torch_floor():
    errors, _ = pre.validate(answers(strategy="fsdp", precision="fp16"))
    assert len(errors) == 1 and "type precision=bf16 (or fp32), or strategy=ddp" in errors[0]
    assert pre.validate(answers(strategy="fsdp"))[0] == []
    assert post.resolve(answers(strategy="fsdp"))[0]["parallel.strategy"] == "fsdp"


def test_unwise_sync_batchnorm_warns():
    _, warnings = pre.validate(answers(gpus_per_node="1", per_device_batch_size="4"))
    assert any("1 GPU in total" in w for w in warnings) and any("below 8" in w for w in warnings)
    assert pre.validate(answers(sync_batchnorm=False, gpus_per_node="1"))[1] == []


def test_resolve_writes_prompted_values():
    settings, notes = post.resolve(answers(precision="fp16", grad_accum_steps="4", compile=True))
    assert settings["train.precision"] == "fp16" and settings["train.grad_accum_steps"] == 4
    assert settings["train.compile"] is True and settings["optim.reference_batch_size"] == 128
    assert settings["dist.gpus_per_node"] == 8 and notes == []
    assert settings["run.trackers"] == [] and post.resolve(answers(tracker="mlflow"))[0]["run.trackers"] == ["mlflow"]


def test_resolve_turns_sync_batchnorm_off_on_one_gpu():
    settings, notes = post.resolve(answers(gpus_per_node="1"))
    assert settings["parallel.sync_batchnorm"] is False and "one GPU" in notes[0]


def test_the_language_model_needs_no_sync_batchnorm_and_says_why():
    settings, notes = post.resolve(answers(task="language_model"))
    assert settings["parallel.sync_batchnorm"] is False and "no BatchNorm" in notes[0]
    assert pre.validate(answers(task="language_model", per_device_batch_size="4")) == ([], [])


def test_set_yaml_values_keeps_comments_and_columns():
    raw = (TEMPLATE / "{{cookiecutter.project_slug}}" / "configs" / "default.yaml").read_text()
    text = jinja2.Template(raw, keep_trailing_newline=True).render(cookiecutter=DEFAULTS)
    new = post.set_yaml_values(text, {"train.precision": "fp16", "train.compile": True, "data.batch_size": 64})
    assert yaml.safe_load(new)["train"]["precision"] == "fp16" and yaml.safe_load(new)["data"]["batch_size"] == 64
    old_lines, new_lines = text.splitlines(), new.splitlines()
    assert len(old_lines) == len(new_lines)
    for old, line in zip(old_lines, new_lines, strict=True):
        if "#" in old and "#" in line:
            assert old[old.index("#") :] == line[line.index("#") :]
    changed = [line for old, line in zip(old_lines, new_lines, strict=True) if old != line]
    assert changed == [
        "  batch_size: 64         # per device; global = batch_size x world size x grad_accum_steps",
        "  precision: fp16        # bf16 | fp16 (with GradScaler) | fp32",
        "  compile: true          # torch.compile the model before wrapping it in DDP",
    ]


def test_set_dataclass_defaults_writes_the_answers_into_config_py_keeping_comments():
    package = TEMPLATE / "{{cookiecutter.project_slug}}" / "src" / "{{cookiecutter.package_name}}"
    text = jinja2.Template((package / "config.py").read_text(), keep_trailing_newline=True).render(
        cookiecutter=DEFAULTS
    )
    values = {
        "train.precision": "fp32",
        "parallel.strategy": "fsdp",
        "train.grad_accum_steps": 4,
        "train.compile": True,
    }
    new = post.set_dataclass_defaults(text, values)
    changed = [(old, line) for old, line in zip(text.splitlines(), new.splitlines(), strict=True) if old != line]
    assert [line for _, line in changed] == [
        "    grad_accum_steps: PositiveInt = 4  # micro-batches per optimizer step; only the last all-reduces",
        '    precision: Precision = "fp32"  # bf16 | fp16 (with GradScaler) | fp32',
        "    compile: bool = True  # torch.compile the model before wrapping it in DDP",
        '    strategy: Strategy = "fsdp"  # ddp: the whole model on every device; fsdp: sharded over them (torch>=2.8)',
    ]
    with pytest.raises(KeyError, match="train.nope"):
        post.set_dataclass_defaults(text, {"train.nope": 1})


def test_the_answers_that_are_dataclass_defaults():
    settings, _ = post.resolve(answers())
    assert set(settings) - post.NOT_DATACLASS_DEFAULTS == {
        "data.batch_size",
        "train.precision",
        "train.compile",
        "train.grad_accum_steps",
        "parallel.strategy",
        "parallel.sync_batchnorm",
        "optim.reference_batch_size",
        "dist.gpus_per_node",
        "dist.num_nodes",
    }


def test_set_yaml_values_rejects_unknown_keys():
    with pytest.raises(KeyError, match="train.nope"):
        post.set_yaml_values("train:\n  lr: 1  # x\n", {"train.nope": 1})


def test_remove_unchosen_uses_the_table(tmp_path):
    kubernetes = ["k8s/jobset.yaml", "Dockerfile", ".dockerignore", "tests/test_kubernetes.py"]
    for name in ("scripts/train.sbatch", "tests/test_sbatch.py", "LICENSE", "keep.txt", *kubernetes):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    removed = post.remove_unchosen(tmp_path, answers(slurm=False, license="none", kubernetes=False))
    expected = [".dockerignore", "Dockerfile", "LICENSE", "k8s", "scripts/train.sbatch"]
    assert sorted(removed) == [*expected, "tests/test_kubernetes.py", "tests/test_sbatch.py"]
    assert (tmp_path / "keep.txt").exists() and not (tmp_path / "k8s").exists()
    (tmp_path / "examples" / "regression").mkdir(parents=True)
    assert post.remove_unchosen(tmp_path, answers(task="image_classification"))[-2:] == [
        "examples",
        "tests/test_swaps.py",
    ]  # the swaps of the classifier's seam
    assert not (tmp_path / "examples").exists()
    for name in ("regression", "huggingface"):  # the language model's starter brings its own example
        (tmp_path / "examples" / name).mkdir(parents=True)
    removed = post.remove_unchosen(tmp_path, answers(task="language_model"))
    assert "examples/regression" in removed and "tests/test_swaps.py" in removed
    assert [p.name for p in (tmp_path / "examples").iterdir()] == ["huggingface"]


def test_summary_states_the_global_batch_and_next_steps():
    settings, notes = post.resolve(answers(gpus_per_node="4", num_nodes="2", grad_accum_steps="2"))
    text = post.summary(answers(), settings, notes)
    assert "32 x 8 x 2 = 512" in text and "scripts/smoke.sh" in text and "SyncBatchNorm on" in text
    assert ".prepare" not in text
    language_model = answers(task="language_model")
    text = post.summary(language_model, *post.resolve(language_model))
    assert "python -m ddp_trainer.tools.prepare TEXT_FILES --out data/mine" in text
    assert "python -m ddp_trainer.tools.sample" in text
    images = answers(task="image_classification")
    text = post.summary(images, *post.resolve(images))
    assert "dataset.root=/data/imagenet" in text and "python -m ddp_trainer.shapes data/shapes" in text
    assert "SyncBatchNorm on" in text and ".prepare" not in text  # torchvision's ResNets have BatchNorm


def test_a_starter_replaces_and_adds_files_and_no_starter_folder_is_left(tmp_path):
    starter = tmp_path / "starters" / "language_model"
    (starter / "src" / "pkg").mkdir(parents=True)
    (starter / "src" / "pkg" / "model.py").write_text("gpt")
    (starter / "src" / "pkg" / "sample.py").write_text("sample")
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "model.py").write_text("mlp")
    assert post.place_starter(tmp_path, "language_model") == ["src/pkg/model.py", "src/pkg/sample.py"]
    assert (tmp_path / "src" / "pkg" / "model.py").read_text() == "gpt" and not (tmp_path / "starters").exists()


def test_answers_record_is_a_replay_file_without_private_keys():
    made_with = answers(_template="gh:me/ddp-template", _output_dir="/home/me", _commit="abc123")
    record = post.answers_record(made_with, "abc123")
    assert json.loads(record) == {"cookiecutter": DEFAULTS, "template_commit": "abc123"}
    assert record.endswith("}\n")


def test_template_commit_prefers_the_one_cruft_passes(tmp_path):
    assert post.template_commit(answers(_commit="abc123", _repo_dir=str(tmp_path))) == "abc123"
    assert post.template_commit(answers(_repo_dir=str(tmp_path))) is None  # not a git checkout
    assert post.template_commit(answers()) is None


def test_template_commit_is_the_checkouts_head_marked_dirty_after_edits(tmp_path, monkeypatch):
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Template Test")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "test@example.invalid")
    template = tmp_path / "template"
    template.mkdir()
    (template / "cookiecutter.json").write_text("{}")
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "template"]):
        subprocess.run(["git", *command], cwd=template, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=template, capture_output=True, text=True).stdout.strip()
    assert post.template_commit(answers(_repo_dir=str(template))) == head
    (template / "cookiecutter.json").write_text('{"changed": 1}')
    assert post.template_commit(answers(_repo_dir=str(template))) == f"{head}-dirty"
    monkeypatch.chdir(tmp_path)  # where cookiecutter ran; the hook runs elsewhere, in the project
    assert post.template_commit(answers(_repo_dir="template")) is None
    (template / "inner").mkdir()
    (template / "inner" / "cookiecutter.json").write_text("{}")  # a template git does not track
    assert post.template_commit(answers(_repo_dir=str(template / "inner"))) is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("description", "two\nlines", "holds a line break"),
        ("author", "  ", "is empty"),
        ("project_name", "a\x07", "control"),
    ],
)
def test_free_text_must_be_one_printable_line(key, value, message):
    errors, _ = pre.validate(answers(**{key: value}))
    assert len(errors) == 1 and errors[0].startswith(key) and message in errors[0]
