"""Every supported combination bakes into a clean project; every bad answer fails early."""

import ast
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import BIN, TEMPLATE, bake, bake_cli

COMMON_FILES = {
    ".cookiecutter.json",
    ".gitignore",
    ".pre-commit-config.yaml",
    "README.md",
    "pyproject.toml",
    "configs/default.yaml",
    "configs/smoke.yaml",
    "docs/checkpoints-and-restarts.md",
    "docs/clusters.md",
    "docs/data-at-scale.md",
    "docs/extending.md",
    "docs/observability.md",
    "docs/strategies-and-memory.md",
    "docs/tests.md",
    "docs/training.md",
    "docs/troubleshooting.md",
    "docs/updating.md",
    "docs/your-model-and-data.md",
    "experiments/example.yaml",
    "examples/contrastive/data.py",
    "examples/contrastive/model.py",
    "examples/contrastive/task.py",
    "examples/detection/data.py",
    "examples/detection/model.py",
    "examples/detection/task.py",
    "examples/image_classifier/data.py",
    "examples/image_classifier/model.py",
    "examples/language_model/data.py",
    "examples/language_model/model.py",
    "examples/language_model/task.py",
    "examples/regression/data.py",
    "examples/regression/model.py",
    "examples/regression/task.py",
    "scripts/common.sh",
    "scripts/smoke.sh",
    "scripts/train.sh",
    "scripts/train_multinode.sh",
    "tests/broken_smoke.py",
    "tests/conftest.py",
    "tests/dist_proofs.py",
    "tests/faulty_train.py",
    "tests/helpers.py",
    "tests/nan_shard_train.py",
    "tests/noisy_train.py",
    "tests/previous_layout.yaml",
    "tests/stand_ins.py",
    "tests/test_activation_checkpointing.py",
    "tests/test_callbacks.py",
    "tests/test_config.py",
    "tests/test_data.py",
    "tests/test_dist.py",
    "tests/test_docs.py",
    "tests/test_distributed.py",
    "tests/test_elastic.py",
    "tests/test_exits.py",
    "tests/test_export.py",
    "tests/test_gpu_paths.py",
    "tests/test_hardware.py",
    "tests/test_launch.py",
    "tests/test_faults.py",
    "tests/test_launchers.py",
    "tests/test_log_over_ranks.py",
    "tests/test_layers.py",
    "tests/test_memory.py",
    "tests/test_metrics.py",
    "tests/test_multinode.py",
    "tests/test_optim.py",
    "tests/test_profiler.py",
    "tests/test_progress.py",
    "tests/test_report.py",
    "tests/test_resume.py",
    "tests/test_packs.py",
    "tests/test_sharded_checkpoints.py",
    "tests/test_parallel.py",
    "tests/test_previous_layout.py",
    "tests/test_processes.py",
    "tests/test_seam.py",
    "tests/test_swaps.py",
    "tests/test_task.py",
    "tests/test_tensorboard.py",
    "tests/test_trackers.py",
    "tests/test_train.py",
    "tests/test_wiring.py",
}
PACKAGE_FILES = {
    "__init__.py",
    "base/__init__.py",
    "base/across_ranks.py",
    "base/batching.py",
    "base/cpus.py",
    "base/dist.py",
    "base/extras.py",
    "base/hardware.py",
    "base/optimizers.py",
    "base/packs.py",
    "base/preemption.py",
    "base/processes.py",
    "base/records.py",
    "base/rendezvous.py",
    "base/rules.py",
    "base/rundir.py",
    "base/scalars.py",
    "base/schedules.py",
    "base/typed_config.py",
    "callbacks/__init__.py",
    "config.py",
    "data.py",
    "loop/__init__.py",
    "loop/best_checkpoints.py",
    "loop/callbacks.py",
    "loop/checkpoint.py",
    "loop/early_stopping.py",
    "loop/elastic.py",
    "loop/ema.py",
    "loop/evaluation.py",
    "loop/loaders.py",
    "loop/metrics.py",
    "loop/optim.py",
    "loop/parallel.py",
    "loop/preflight.py",
    "loop/profiling.py",
    "loop/samplers.py",
    "loop/sharded_checkpoint.py",
    "loop/startup.py",
    "loop/state.py",
    "loop/tensorboard.py",
    "loop/tracking.py",
    "model.py",
    "task.py",
    "tools/__init__.py",
    "tools/checks.py",
    "tools/diagnose.py",
    "tools/evaluate.py",
    "tools/export.py",
    "tools/launch.py",
    "tools/pack.py",
    "tools/pack_writer.py",
    "tools/report.py",
    "tools/saved_activations.py",
    "tools/smoke.py",
    "train.py",
}
SLURM_FILES = {"scripts/train.sbatch", "tests/test_sbatch.py"}
KUBERNETES_FILES = {
    "Dockerfile",
    ".dockerignore",
    "k8s/jobset.yaml",
    "k8s/pvc.yaml",
    "k8s/runtime.yaml",
    "k8s/schema.json",
    "k8s/trainjob.yaml",
    "tests/test_kubernetes.py",
}
CLASSIFIER_ONLY = {f for f in COMMON_FILES if f.startswith("examples/")} | {"tests/test_swaps.py"}
STARTER_PACKAGE_FILES = {
    "image_classification": {"shapes.py"},
    "language_model": {"tools/prepare.py", "tools/sample.py"},
}
# files a starter adds outside its package
STARTER_FILES = {
    "image_classification": {"docs/image-classifier.md"},
    "language_model": {
        "docs/language-model.md",
        "examples/huggingface/model.py",
        "examples/huggingface/task.py",
        "examples/huggingface/tests/test_task.py",
        "tests/test_huggingface.py",
    },
}

SUPPORTED = [
    {},
    {"precision": "fp16", "grad_accum_steps": "4", "sync_batchnorm": False, "compile": True, "slurm": False},
    {"precision": "fp32", "gpus_per_node": "1", "num_nodes": "1", "license": "none", "tracker": "wandb"},
    {
        "precision": "bf16",
        "compile": True,
        "gpus_per_node": "4",
        "num_nodes": "16",
        "license": "BSD-3-Clause",
        "kubernetes": True,
    },
    {"project_name": "Vision Net", "per_device_batch_size": "4", "gpus_per_node": "64", "tracker": "mlflow"},
    {"project_name": "x", "project_slug": "my_trainer", "package_name": "mytrainer", "kubernetes": True},
    {"project_name": "A Very Long Project Name For Testing", "package_name": "a" * 32},
    {"task": "language_model"},
    {"task": "language_model", "strategy": "fsdp", "grad_accum_steps": "2"},
    {"task": "language_model", "precision": "fp32", "gpus_per_node": "1", "slurm": False, "compile": True},
    {"task": "language_model", "precision": "fp16", "grad_accum_steps": "8", "license": "none", "kubernetes": True},
    {"task": "image_classification"},
    {"task": "image_classification", "precision": "fp16", "grad_accum_steps": "2", "compile": True, "slurm": False},
    {"task": "image_classification", "precision": "fp32", "gpus_per_node": "1", "license": "BSD-3-Clause"},
    {"strategy": "fsdp", "precision": "fp32", "compile": True},
]


# the settings the hook writes from the answers into default.yaml and as dataclass defaults
ANSWERED_SETTINGS = [
    "data.batch_size",
    "train.precision",
    "train.compile",
    "parallel.sync_batchnorm",
    "optim.reference_batch_size",
    "dist.gpus_per_node",
    "dist.num_nodes",
]


def dataclass_defaults(config_py: Path) -> dict:
    """{"section.key": default} of the settings whose dataclass default in config.py is a literal."""
    classes = {node.name: node for node in ast.parse(config_py.read_text()).body if isinstance(node, ast.ClassDef)}
    sections = {
        item.target.id: item.annotation.id for item in classes["Config"].body if isinstance(item, ast.AnnAssign)
    }
    defaults = {}
    for section, name in sections.items():
        for item in classes[name].body if name in classes else []:  # model.py's and data.py's: not answers
            if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Constant):
                defaults[f"{section}.{item.target.id}"] = item.value.value
    return defaults


def files_of(project):
    return {str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()}


def expected_files(answers, package):
    files = COMMON_FILES | {f"src/{package}/{name}" for name in PACKAGE_FILES}
    task = answers.get("task", "classifier")
    if task != "classifier":
        files = (files - CLASSIFIER_ONLY) | {f"src/{package}/{name}" for name in STARTER_PACKAGE_FILES[task]}
        files |= STARTER_FILES[task]
    if answers.get("slurm", True):
        files |= SLURM_FILES
    if answers.get("kubernetes", False):
        files |= KUBERNETES_FILES
    if answers.get("license", "MIT") != "none":
        files.add("LICENSE")
    return files


@pytest.mark.parametrize("answers", SUPPORTED, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "defaults")
def test_supported_combination_bakes_clean(tmp_path, answers):
    project = bake(tmp_path, **answers)
    package = answers.get("package_name") or project.name.replace("-", "_")
    assert files_of(project) == expected_files(answers, package)
    for path in project.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"\{\{|\{%|\{#", text), f"unrendered Jinja in {path}"
            # what the project's pre-commit hooks (end-of-file-fixer, trailing-whitespace) would rewrite
            assert text == "" or (text.endswith("\n") and not text.endswith("\n\n")), f"{path} must end in one newline"
            assert not re.search(r"[ \t]+$", text, re.M), f"trailing whitespace in {path}"
    config = yaml.safe_load((project / "configs" / "default.yaml").read_text())
    assert config["train"]["precision"] == answers.get("precision", "bf16")
    assert config["train"]["compile"] is answers.get("compile", False)
    assert config["train"]["grad_accum_steps"] == int(answers.get("grad_accum_steps", "1"))
    assert config["parallel"]["strategy"] == answers.get("strategy", "ddp")
    floor = "torch>=2.8" if answers.get("strategy") == "fsdp" else "torch>=2.4"
    assert f'"{floor}"' in (project / "pyproject.toml").read_text()
    assert config["data"]["batch_size"] == int(answers.get("per_device_batch_size", "32"))
    total_gpus = int(answers.get("gpus_per_node", "8")) * int(answers.get("num_nodes", "1"))
    batch_norm = answers.get("task", "classifier") != "language_model"  # the language model has none
    sync_batchnorm = answers.get("sync_batchnorm", True) and total_gpus > 1 and batch_norm
    assert config["parallel"]["sync_batchnorm"] is sync_batchnorm
    assert config["dist"]["gpus_per_node"] == int(answers.get("gpus_per_node", "8"))
    tracker = answers.get("tracker", "tensorboard")
    assert config["run"]["trackers"] == ([] if tracker == "tensorboard" else [tracker])
    # every file a run reads starts from the answers, the tests' configs/smoke.yaml too
    defaults = dataclass_defaults(project / "src" / package / "config.py")
    answered = {f"{name}.{key}": value for name, section in config.items() for key, value in section.items()}
    assert {key: defaults[key] for key in ANSWERED_SETTINGS} == {key: answered[key] for key in ANSWERED_SETTINGS}
    dev_extra = re.search(r"^dev = \[(.*?)^\]", (project / "pyproject.toml").read_text(), re.S | re.M).group(1)
    assert {name for name in ("wandb", "mlflow") if f'"{name}>=' in dev_extra} == ({tracker} - {"tensorboard"})
    for script in (project / "scripts").glob("*.sh"):
        if script.name != "common.sh":
            assert script.stat().st_mode & stat.S_IXUSR
    lint = subprocess.run([str(BIN / "ruff"), "check", "--no-cache", str(project)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    fmt = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "--no-cache", str(project)],
        capture_output=True,
        text=True,
        cwd=project,
    )
    assert fmt.returncode == 0, fmt.stdout
    layers = [str(BIN / "lint-imports"), str(project / "pyproject.toml"), "--no-cache", "--no-logo"]
    layers = subprocess.run(layers, capture_output=True, text=True, cwd=project / "src")
    assert layers.returncode == 0 and "Contracts: 2 kept, 0 broken." in layers.stdout, layers.stdout


FREE_TEXT = {
    "project_name": 'Zoë\'s "Fast" Net',
    "description": 'Trains \\ things "fast" with \'\'\' and """ quotes, naïvely',
    "author": 'Zoë "Z" O\'Brien \\ Ångström',
}


def test_free_text_answers_come_through_intact_in_every_file(tmp_path):
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = bake(tmp_path, **FREE_TEXT, project_slug="fast-net")
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == FREE_TEXT["description"] and meta["authors"] == [{"name": FREE_TEXT["author"]}]
    init = (project / "src" / "fast_net" / "__init__.py").read_text()
    assert ast.get_docstring(ast.parse(init)) == FREE_TEXT["description"]
    readme = (project / "README.md").read_text()
    assert f"# {FREE_TEXT['project_name']}" in readme and FREE_TEXT["description"] in readme
    assert FREE_TEXT["author"] in (project / "LICENSE").read_text()
    lint = subprocess.run([str(BIN / "ruff"), "check", "--no-cache", str(project)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


def test_no_jinja_control_blocks_in_python_files():
    for path in (TEMPLATE / "{{cookiecutter.project_slug}}").rglob("*.py"):
        assert not re.search(r"\{%-?\s*(if|for|elif|else|endif|endfor)", path.read_text()), path


def test_cli_answers_land_in_the_config(tmp_path):
    result = bake_cli(
        tmp_path, "precision=fp16", "grad_accum_steps=4", "sync_batchnorm=false", "compile=true", "slurm=false"
    )
    assert result.returncode == 0, result.stderr
    settings = yaml.safe_load((tmp_path / "ddp-trainer" / "configs" / "default.yaml").read_text())
    train, sync_batchnorm = settings["train"], settings["parallel"]["sync_batchnorm"]
    assert (train["precision"], train["grad_accum_steps"], sync_batchnorm, train["compile"]) == (
        "fp16",
        4,
        False,
        True,
    )
    assert not (tmp_path / "ddp-trainer" / "scripts" / "train.sbatch").exists()
    assert "global batch on 8 GPU(s): 32 x 8 x 4 = 1024" in result.stdout


def test_prompts_answered_on_stdin(tmp_path):
    # project name, then Enter for every other question
    result = bake_cli(tmp_path, stdin="Image Classifier\n" + "\n" * 20)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "image-classifier" / "src" / "image_classifier" / "train.py").exists()


UNSUPPORTED = [
    (["gpus_per_node=0"], "gpus_per_node 0 is out of range: use 1 to 64"),
    (["gpus_per_node=100"], "gpus_per_node 100 is out of range"),
    (["num_nodes=0"], "num_nodes 0 is out of range"),
    (["per_device_batch_size=0"], "per_device_batch_size 0 is out of range"),
    (["grad_accum_steps=x"], "grad_accum_steps 'x' is not a whole number"),
    (["project_slug=My-Project!"], "project_slug 'My-Project!' is not a valid directory name"),
    (["package_name=torch"], "package_name 'torch' would shadow the module of that name"),
    (["package_name=test"], "package_name 'test' would shadow"),
    (["package_name=My-Pkg"], "package_name 'My-Pkg' is not a lowercase Python identifier"),
    ([f"package_name={'a' * 33}"], "is longer than 32 characters"),
    ([f"project_slug={'a' * 41}", "package_name=a", "kubernetes=true"], "too long for the Kubernetes names"),
    (["author=A\tB"], "author 'A\\tB' holds a line break or control character"),
    (["description= "], "description is empty"),
]


@pytest.mark.parametrize(("answers", "message"), UNSUPPORTED, ids=lambda a: a[0] if isinstance(a, list) else "")
def test_unsupported_answer_fails_in_the_pre_gen_hook(tmp_path, answers, message):
    result = bake_cli(tmp_path, *answers)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert message in errors[0]  # one line per problem; a bad slug also makes a bad derived package
    assert os.listdir(tmp_path) == []


def test_replay_reproduces_a_project(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))
    args = [str(BIN / "cookiecutter"), str(TEMPLATE), "--no-input", "precision=fp32", "-o", str(tmp_path / "b")]
    assert subprocess.run(args, env=env, capture_output=True, timeout=60).returncode == 0
    replayed = subprocess.run(
        [str(BIN / "cookiecutter"), str(TEMPLATE), "--replay", "-o", str(tmp_path / "c")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replayed.returncode == 0, replayed.stderr
    configs = [(tmp_path / d / "ddp-trainer" / "configs" / "default.yaml").read_text() for d in ("b", "c")]
    assert configs[0] == configs[1] and "precision: fp32" in configs[1]
