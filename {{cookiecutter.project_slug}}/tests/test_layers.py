"""The package's layers hold, as import-linter checks them (the contracts in pyproject.toml):
the commands (tools/) above the entry (train.py), the entry above the loop's components (loop/),
those above the settings and your room, and everything above the foundations (base/); no module
in an import circle."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PROJECT

LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")


@pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed: pip install -e '.[dev]'")
def test_every_module_sits_in_its_layer_and_none_is_in_an_import_circle():
    # from src/, where the package is importable without installing it
    command = [LINT_IMPORTS, str(PROJECT / "pyproject.toml"), "--no-cache", "--no-logo"]
    result = subprocess.run(command, cwd=PROJECT / "src", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_the_foundations_name_no_setting_of_a_run_not_even_in_a_type_hint():
    # import-linter leaves type-only imports out; the foundations take the sections they read instead
    base = PROJECT / "src" / "{{ cookiecutter.package_name }}" / "base"
    for module in base.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module != "config", f"base/{module.name} imports the settings"
