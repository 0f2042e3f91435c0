"""Validate the answers before cookiecutter writes anything.

Each problem is one line saying what is wrong and what to type instead; any error exits 1,
so cookiecutter removes the half-made directory. Unwise but legal combinations only warn.
"""

from __future__ import annotations

import json
import keyword
import re
import sys

# Rendered by cookiecutter; the module stays valid Python so tests can import its functions.
ANSWERS_JSON = r"""{{ cookiecutter | tojson }}"""

MAX_GPUS_PER_NODE = 64
MAX_NODES = 4096
# names that would shadow what the project imports or how it is tested
RESERVED_PACKAGES = {
    "torch",
    "torchvision",
    "torchaudio",
    "numpy",
    "yaml",
    "tqdm",
    "pytest",
    "test",
    "tests",
    "setuptools",
    "pip",
    "cookiecutter",
    "src",
    "scripts",
    "configs",
    "ruff",
    "triton",
}
MAX_NAME_LENGTH = 32  # generated lines that hold the package name stay within the 120-column lint
SLUG_PATTERN = re.compile(r"^[a-z][a-z0-9_-]*$")
PACKAGE_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


def check_slug(slug: str) -> str | None:
    if not SLUG_PATTERN.match(slug):
        return (
            f"project_slug {slug!r} is not a valid directory name: use lowercase letters, digits, "
            f"'-' and '_', starting with a letter (e.g. {_suggest(slug, '-')!r})"
        )
    return None


def check_package(name: str) -> str | None:
    if not PACKAGE_PATTERN.match(name):
        return (
            f"package_name {name!r} is not a lowercase Python identifier: use letters, digits and '_', "
            f"starting with a letter (e.g. {_suggest(name, '_')!r})"
        )
    if len(name) > MAX_NAME_LENGTH:
        return f"package_name {name!r} is longer than {MAX_NAME_LENGTH} characters: pick a shorter one"
    if keyword.iskeyword(name) or name in RESERVED_PACKAGES or name in sys.stdlib_module_names:
        return (
            f"package_name {name!r} would shadow the module of that name "
            f"(a keyword, stdlib or dependency): pick another, e.g. {name + '_train'!r}"
        )
    return None


def _suggest(text: str, sep: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    suggestion = sep.join(words).lstrip("0123456789" + sep)
    return suggestion or "my" + sep + "project"


def check_one_line(answers: dict, key: str) -> str | None:
    """Free text is written escaped into TOML and Python; only line breaks and control
    characters cannot be carried into a one-line title, description or author."""
    text = str(answers[key])
    if not text.strip():
        return f"{key} is empty: type a few words"
    if any(ord(char) < 32 or ord(char) == 127 for char in text):
        return f"{key} {text!r} holds a line break or control character: type it on one line"
    return None


# JobSet names a pod <slug>-node-<job>-<pod>-<5 random>, and Kubernetes allows 63 characters
MAX_KUBERNETES_SLUG = 63 - len("-node-0-0-xxxxx") - 8  # room for 1000+ nodes and restarts


def check_kubernetes_slug(answers: dict) -> str | None:
    slug = answers["project_slug"]
    if not answers.get("kubernetes") or len(slug) <= MAX_KUBERNETES_SLUG:
        return None
    return (
        f"project_slug {slug!r} is longer than {MAX_KUBERNETES_SLUG} characters, too long for the Kubernetes "
        f"names made from it (a JobSet pod is <slug>-node-0-0-xxxxx, at most 63): pick a shorter project_slug"
    )


def check_count(answers: dict, key: str, maximum: int) -> str | None:
    raw = str(answers[key]).strip()
    if not re.fullmatch(r"\d+", raw):
        return f"{key} {answers[key]!r} is not a whole number: type e.g. {key}=1"
    if not 1 <= int(raw) <= maximum:
        return f"{key} {raw} is out of range: use 1 to {maximum}"
    return None


def validate(answers: dict) -> tuple[list[str], list[str]]:
    """(errors, warnings) for a full set of answers."""
    errors = [
        check_slug(answers["project_slug"]),
        check_package(answers["package_name"]),
        check_count(answers, "gpus_per_node", MAX_GPUS_PER_NODE),
        check_count(answers, "num_nodes", MAX_NODES),
        check_count(answers, "grad_accum_steps", 1024),
        check_count(answers, "per_device_batch_size", 65536),
        *(check_one_line(answers, key) for key in ("project_name", "description", "author")),
        check_kubernetes_slug(answers),
    ]
    if answers.get("strategy") == "fsdp" and answers["precision"] == "fp16":
        errors.append(
            "precision fp16 with strategy fsdp: GradScaler would see one rank's shard only; "
            "type precision=bf16 (or fp32), or strategy=ddp"
        )
    errors = [e for e in errors if e]
    warnings = []
    if not errors and answers["sync_batchnorm"] and answers["task"] != "language_model":  # LM: no BatchNorm
        total_gpus = int(answers["gpus_per_node"]) * int(answers["num_nodes"])
        if total_gpus == 1:
            warnings.append("sync_batchnorm with 1 GPU in total has nothing to synchronise: it will be off")
        if int(answers["per_device_batch_size"]) < 8:
            warnings.append(
                "sync_batchnorm with a per-device batch below 8 gives noisy statistics: "
                "prefer model.norm=layer (LayerNorm) for such small batches"
            )
    return errors, warnings


def main() -> int:
    errors, warnings = validate(json.loads(ANSWERS_JSON))
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
