"""Turn the answers into the project's settings.

1. put the chosen starter's files in place: starters/<task>/ mirrors the project, and each of
   its files replaces the one at the same path (the classifier's seam and tests by default),
2. resolve the answers into config values (the only place this happens),
3. write them into configs/default.yaml, keeping its comments, and as the defaults of config.py's
   dataclasses (but NOT_DATACLASS_DEFAULTS), so that every file a run reads starts from them
   (configs/smoke.yaml, the tests' run, names only what it changes over them),
4. remove the per-project files that were not chosen (one table),
5. record the answers and the template commit in .cookiecutter.json,
6. print a short summary.

cruft runs this hook again on both renders it diffs for `cruft update`, so a file removed here
stays out of the project after an update, even one the template adds to OPTIONAL_FILES later.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Rendered by cookiecutter; the module stays valid Python so tests can import its functions.
ANSWERS_JSON = r"""{{ cookiecutter | tojson }}"""

CLASSIFIER_SWAPS = ("image_classifier", "language_model", "regression", "detection", "contrastive")  # examples/<name>/
# (answer, values that drop the files, files relative to the project root)
OPTIONAL_FILES = [
    ("slurm", (False,), ["scripts/train.sbatch", "tests/test_sbatch.py"]),
    ("kubernetes", (False,), ["k8s", "Dockerfile", ".dockerignore", "tests/test_kubernetes.py"]),
    ("license", ("none",), ["LICENSE"]),
    # the worked swaps replace the classifier's seam files; the other starters have their own, and
    # the language model's example (a Hugging Face model) comes from its starter's folder
    ("task", ("image_classification",), ["examples", "tests/test_swaps.py"]),
    ("task", ("language_model",), [*(f"examples/{name}" for name in CLASSIFIER_SWAPS), "tests/test_swaps.py"]),
]
STARTERS = "starters"  # starters/<task>/...: the files a task replaces or adds
# cookiecutter's replay format (`cookiecutter --replay-file`), plus the template commit for `cruft link`
ANSWERS_FILE = ".cookiecutter.json"


def resolve(answers: dict) -> tuple[dict, list[str]]:
    """Config values ("section.key" -> value) from the answers, and notes on what changed why."""
    gpus, nodes = int(answers["gpus_per_node"]), int(answers["num_nodes"])
    batch, accum = int(answers["per_device_batch_size"]), int(answers["grad_accum_steps"])
    notes = []
    sync_bn = bool(answers["sync_batchnorm"])
    if sync_bn and answers["task"] == "language_model":
        sync_bn = False
        notes.append("SyncBatchNorm off: the language model has no BatchNorm (LayerNorm needs no sync)")
    elif sync_bn and gpus * nodes == 1:
        sync_bn = False
        notes.append("SyncBatchNorm off: one GPU in total has nothing to synchronise")
    settings = {
        "data.batch_size": batch,
        "train.grad_accum_steps": accum,
        "parallel.strategy": answers["strategy"],
        "train.precision": answers["precision"],
        "train.compile": bool(answers["compile"]),
        "parallel.sync_batchnorm": sync_bn,
        # the lr in default.yaml is taken as tuned for one device with these settings;
        # runs on more devices scale it from this reference (optim.lr_scaling)
        "optim.reference_batch_size": batch * accum,
        "dist.gpus_per_node": gpus,
        "dist.num_nodes": nodes,
        "run.trackers": [] if answers["tracker"] == "tensorboard" else [answers["tracker"]],
    }
    return settings, notes


def set_yaml_values(text: str, values: dict) -> str:
    """Replace `key: value` under `section:` in a two-level YAML file, keeping comments."""
    lines, section, pending = text.splitlines(), None, dict(values)
    for i, line in enumerate(lines):
        top = re.match(r"^(\w+):\s*(#.*)?$", line)
        if top:
            section = top.group(1)
            continue
        entry = re.match(r"^(\s+)(\w+):[^#]*?(\s*#.*)?$", line)
        if entry and f"{section}.{entry.group(2)}" in pending:
            indent, key, comment = entry.groups()
            head = f"{indent}{key}: {_yaml_scalar(pending.pop(f'{section}.{key}'))}"
            if comment:  # keep the comment in its column
                head = head.ljust(line.index("#") - 1) + " " + comment.strip()
            lines[i] = head
    if pending:
        raise KeyError(f"configs/default.yaml has no key {sorted(pending)[0]}")
    return "\n".join(lines) + "\n"


# answers written into configs/default.yaml only: a file that does not name them (configs/smoke.yaml,
# the tests' run) keeps the dataclass's value
NOT_DATACLASS_DEFAULTS = {
    "run.trackers",  # a file that names no tracker reports to none
}


def set_dataclass_defaults(source: str, values: dict) -> str:
    """config.py's text with the default of each "section.key" of `values` (its section's class
    found in `class Config`) replaced by the value, the field's comment kept."""
    lines, blocks, current = source.splitlines(), {}, None
    for index, line in enumerate(lines):  # class name -> the indices of its body's lines
        top = re.match(r"^class (\w+)\b", line)
        if top:
            current = blocks.setdefault(top.group(1), [])
        elif line and not line[0].isspace():
            current = None
        elif current is not None:
            current.append(index)
    sections = {}
    for index in blocks.get("Config", []):
        section = re.match(r"^    (\w+): (\w+) = field\(default_factory=\2\)", lines[index])
        if section:
            sections[section.group(1)] = section.group(2)
    pending = dict(values)
    for key, value in values.items():
        section, name = key.split(".")
        for index in blocks.get(sections.get(section), []):
            entry = re.match(rf"^(    {name}: [^=]+= )(.+?)((?:  # .*)?)$", lines[index])
            if entry:
                lines[index] = entry.group(1) + _python_literal(value) + entry.group(3)
                pending.pop(key)
                break
    if pending:
        raise KeyError(f"config.py has no dataclass default for {sorted(pending)[0]}")
    return "\n".join(lines) + "\n"


def _python_literal(value) -> str:
    if isinstance(value, bool | int):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # double quotes, as the project's style
    raise TypeError(f"no dataclass default is written for {value!r}")


def _yaml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(_yaml_scalar, value)) + "]"
    return str(value)


def place_starter(project: Path, task: str) -> list[str]:
    """Move the chosen starter's files over the project's; drop every starter's folder."""
    starter, placed = project / STARTERS / task, []
    if starter.is_dir():
        for source in sorted(path for path in starter.rglob("*") if path.is_file()):
            name = source.relative_to(starter).as_posix()
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            source.replace(project / name)
            placed.append(name)
    shutil.rmtree(project / STARTERS, ignore_errors=True)
    return placed


def remove_unchosen(project: Path, answers: dict) -> list[str]:
    removed = []
    for answer, dropping_values, files in OPTIONAL_FILES:
        if answers[answer] in dropping_values:
            for name in files:
                path = project / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
                removed.append(name)
    return removed


def answers_record(answers: dict, commit: str | None) -> str:
    """The answers as a replay file; private keys (machine paths, cruft's bookkeeping) are left
    out so that every render with the same answers and commit writes the same bytes."""
    chosen = {key: value for key, value in answers.items() if not key.startswith("_")}
    return json.dumps({"cookiecutter": chosen, "template_commit": commit}, indent=2) + "\n"


def template_commit(answers: dict) -> str | None:
    """The template's git commit: cruft passes it in; under plain cookiecutter it is the HEAD of
    the template's checkout, marked "-dirty" when the files there differ from that commit."""
    if answers.get("_commit"):
        return answers["_commit"]
    repo = answers.get("_repo_dir") or ""
    # a relative path is relative to where cookiecutter ran, which this hook (run in the project) cannot know
    if not os.path.isabs(repo) or not _git(repo, "ls-files", "cookiecutter.json"):
        return None  # no git checkout that holds this template: better no commit than a wrong one
    head = _git(repo, "rev-parse", "HEAD")
    if not head:
        return None
    return f"{head}-dirty" if _git(repo, "status", "--porcelain", "--", ".") else head


def _git(cwd: str, *args: str) -> str | None:
    """stdout of a read-only git command, or None where git or the repository is missing."""
    command = ["git", "--no-optional-locks", *args]  # no index refresh: never blocks a commit there
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def summary(answers: dict, settings: dict, notes: list[str]) -> str:
    on_off = {True: "on", False: "off"}
    world = settings["dist.gpus_per_node"] * settings["dist.num_nodes"]
    global_batch = settings["data.batch_size"] * world * settings["train.grad_accum_steps"]
    lines = [
        f"Created {answers['project_slug']} (package {answers['package_name']}).",
        f"  {settings['parallel.strategy']}, precision {settings['train.precision']}, "
        f"SyncBatchNorm {on_off[settings['parallel.sync_batchnorm']]}, "
        f"torch.compile {on_off[settings['train.compile']]}, accumulation {settings['train.grad_accum_steps']}",
        f"  global batch on {world} GPU(s): {settings['data.batch_size']} x {world} x "
        f"{settings['train.grad_accum_steps']} = {global_batch}",
        *[f"  note: {note}" for note in notes],
        "Next:",
        f"  cd {answers['project_slug']} && python -m pip install -e '.[dev]'",
        "  scripts/smoke.sh      # checks the wiring on this machine's GPUs (2 CPU processes without GPUs)",
        "  scripts/train.sh      # trains on every local GPU",
    ]
    if answers["tracker"] != "tensorboard":
        tracker = answers["tracker"]
        lines.append(f"  tracker: {tracker} on rank 0; set it up with its own variables (docs/observability.md)")
    package = answers["package_name"]
    if answers["task"] == "image_classification":
        lines += [
            "  scripts/train.sh dataset.root=/data/imagenet   # your ImageFolder tree: train/<class>/*, val/<class>/*",
            f"  python -m {package}.shapes data/shapes          # a sample tree to look at (trained on by default)",
        ]
    if answers["task"] == "language_model":
        lines += [
            f"  python -m {package}.tools.prepare TEXT_FILES --out data/mine && scripts/train.sh dataset.dir=data/mine",
            f"  python -m {package}.tools.sample runs/default --prompt 'def ' --tokens 200",
        ]
    return "\n".join(lines)


def main() -> int:
    answers = json.loads(ANSWERS_JSON)
    project = Path.cwd()
    place_starter(project, answers["task"])
    settings, notes = resolve(answers)
    config_path = project / "configs" / "default.yaml"
    config_path.write_text(set_yaml_values(config_path.read_text(), settings))
    module = project / "src" / answers["package_name"] / "config.py"
    defaults = {key: value for key, value in settings.items() if key not in NOT_DATACLASS_DEFAULTS}
    module.write_text(set_dataclass_defaults(module.read_text(), defaults))
    remove_unchosen(project, answers)
    (project / ANSWERS_FILE).write_text(answers_record(answers, template_commit(answers)))
    print(summary(answers, settings, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
