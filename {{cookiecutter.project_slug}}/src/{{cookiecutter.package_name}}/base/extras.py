"""The optional packages, checked one way: a setting that needs one names the extra that installs
it, in one line, before anything starts; a setting that only uses one where installed (auto) asks
`installed`. None of them is imported before it is used.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from .rules import ConfigError

# the project's extra (pyproject.toml) that installs each optional package
EXTRA_OF = {
    "tensorboard": "viz",
    "matplotlib": "viz",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "litdata": "shards",
    "boto3": "shards",
    "safetensors": "export",
    "transformers": "huggingface",
    "tokenizers": "huggingface",
}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def install_line(package: str) -> str:
    return f"pip install -e '.[{EXTRA_OF[package]}]'"


def missing(package: str, needed_for: str) -> ConfigError:
    """The one-line error for `needed_for` (a setting, or a command) without `package`."""
    return ConfigError(f"{needed_for} needs {package}, which is not installed: {install_line(package)}")


def require(package: str, needed_for: str) -> ModuleType:
    """The package, imported; or the one-line error naming its extra."""
    if not installed(package):
        raise missing(package, needed_for)
    return importlib.import_module(package)
