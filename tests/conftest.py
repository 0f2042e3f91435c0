"""Helpers for baking projects from this template in tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def load_hook(name: str):
    """Import a hook file as a module (hooks are not a package; their Jinja sits in one string)."""
    spec = importlib.util.spec_from_file_location(name, TEMPLATE / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bake(output_dir: Path, **answers) -> Path:
    """Generate a project without prompts; returns its directory."""
    return Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=answers, output_dir=str(output_dir)))


def bake_cli(output_dir: Path, *answers: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The cookiecutter command line, as users run it."""
    args = [str(BIN / "cookiecutter"), str(TEMPLATE), "-o", str(output_dir)]
    if stdin is None:
        args.append("--no-input")
    return subprocess.run([*args, *answers], input=stdin, capture_output=True, text=True, timeout=60)
