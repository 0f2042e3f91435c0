"""The README and docs/ stay true: every command they show names a module, script, config file or
setting that exists, every test they cite exists, every link lands, what they say of the code
holds, and the README stays a front door (under 250 lines, the rest in docs/). The pages read in
short sentences."""

import ast
import importlib
import importlib.util
import inspect
import re
from functools import cache
from pathlib import Path

import pytest
from conftest import PACKAGE, PROJECT
from torch import nn

from {{ cookiecutter.package_name }} import config, train
from {{ cookiecutter.package_name }}.loop import parallel
from {{ cookiecutter.package_name }}.tools import diagnose, smoke

PAGES = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
FILE_SUFFIXES = {"py", "pt", "yaml", "json", "jsonl", "md", "sh", "sbatch", "png", "bin", "safetensors", "txt", "npy"}
SETTING = re.compile(r"(?<![\w./-])(" + "|".join(config.Config.__dataclass_fields__) + r")\.([a-z_][a-z0-9_]*)\b(?!\()")
# the earlier names of settings that moved: only the page that maps them may name them
EARLIER_NAMES_PAGE = "updating.md"


def text_of(page: Path) -> str:
    """A page without its Python examples (their names are code, not settings or commands)."""
    return re.sub(r"```python\n.*?```", "", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_module_a_page_runs_exists(page):
    for module in set(re.findall(rf"python -m ({PACKAGE}(?:\.\w+)+)", text_of(page))):
        assert importlib.util.find_spec(module) is not None, f"{page.name}: python -m {module}: no such module"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_setting_a_page_names_exists(page):
    fields = {name: {f for f in type(section).__dataclass_fields__} for name, section in vars(config.Config()).items()}
    fields["model"] |= example_fields("ModelConfig")  # a page may describe a swap's settings too
    fields["dataset"] |= example_fields("DatasetConfig")
    for section, key in set(SETTING.findall(text_of(page))):
        name = f"{section}.{key}"
        if key in FILE_SUFFIXES or key in fields[section] or module_has(section, key):
            continue
        if name in config.RENAMED:
            assert page.name == EARLIER_NAMES_PAGE, f"{page.name}: {name} is now {config.RENAMED[name]}"
            continue
        raise AssertionError(f"{page.name}: {name} is no setting of [{section}] (and no name of a module {section})")


@cache
def example_fields(dataclass_name: str) -> set[str]:
    """The settings the seams in examples/ declare in their `dataclass_name`."""
    found = set()
    for path in (PROJECT / "examples").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == dataclass_name:
                found |= {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}
    return found


@cache
def module_has(name: str, attribute: str) -> bool:
    """Whether a module of the package called `name` (train, dist, config, ...) has `attribute`."""
    for place in (f"{PACKAGE}.{name}", f"{PACKAGE}.loop.{name}", f"{PACKAGE}.base.{name}"):
        try:
            return hasattr(importlib.import_module(place), attribute)
        except ModuleNotFoundError:
            continue
    return False


@cache
def is_module(name: str) -> bool:
    """Whether the package has a module `name` (train, task, batching, checkpoint, tools.export, ...)."""
    places = (f"{PACKAGE}.{name}", *(f"{PACKAGE}.{layer}.{name}" for layer in ("loop", "base", "tools")))
    for place in places:
        try:
            if importlib.util.find_spec(place) is not None:
                return True
        except ModuleNotFoundError:  # a parent that is no package
            continue
    return False


def strings_of(path: Path) -> list[str]:
    """The string constants of a source file that are not docstrings, f-strings' literal parts
    included: what it prints and raises."""
    tree = ast.parse(path.read_text())
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, documented) and node.body and isinstance(node.body[0], ast.Expr)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_every_helper_the_packages_messages_name_exists():
    # a message that sends the user to module.name (batching.unwrap, task.build_scheduler) must name
    # one that exists: a helper renamed or removed leaves no message pointing at it
    fields = {name: {f for f in type(section).__dataclass_fields__} for name, section in vars(config.Config()).items()}
    sources = sorted((PROJECT / "src" / PACKAGE).rglob("*.py"))
    # the seam's functions, whatever task.py holds now: those the package calls or looks for
    seam = {name for path in sources for name in re.findall(r'hasattr\(task, "(\w+)"\)', path.read_text())}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "task":
                seam.add(node.attr)
    wrong = []
    for path in sources:
        for text in strings_of(path):
            named = re.findall(r"(?<![\w./-])([a-z_][a-z0-9_]*)\.([a-z_][a-z0-9_]*)\b(?!\.\w)(\(?)", text)
            for module, attribute, called in set(named):
                if called and not is_module(module) and importlib.util.find_spec(module) is None:
                    wrong.append(f"{path.name}: {module}.{attribute}(), and there is no module {module}")
                if not is_module(module) or attribute in FILE_SUFFIXES or attribute in fields.get(module, ()):
                    continue
                if f"{module}.{attribute}" in config.RENAMED or is_module(f"{module}.{attribute}"):
                    continue  # a setting's earlier name; a module of a layer (tools.export)
                if module == "model" and hasattr(nn.Module, attribute):
                    continue  # the variable a loader line calls, not model.py
                if module_has(module, attribute) or (module == "task" and attribute in seam):
                    continue
                wrong.append(f"{path.name}: {module}.{attribute}")
    assert not wrong, f"messages name helpers that do not exist: {sorted(set(wrong))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_file_a_page_names_in_the_project_exists(page):
    text = text_of(page)
    for name in set(re.findall(r"(?<![\w/.-])((?:scripts|configs|experiments|k8s)/[\w.-]+\.\w+)", text)):
        assert (PROJECT / name).exists(), f"{page.name}: {name} does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_test_a_page_cites_exists(page):
    cited = []
    for line in text_of(page).splitlines():
        current = None
        for file, name in re.findall(r"(?:(test_\w+\.py))?::(test_\w+)", line):
            current = file or current
            cited.append((current, name))
        for file in re.findall(r"`(?:tests/)?(test_\w+\.py)`", line):
            cited.append((file, None))
    for file, name in cited:
        assert file is not None and (PROJECT / "tests" / file).exists(), f"{page.name}: tests/{file} does not exist"
        if name is not None:
            assert name in functions_of(file), f"{page.name}: {file}::{name} does not exist"


@cache
def functions_of(file: str) -> set[str]:
    tree = ast.parse((PROJECT / "tests" / file).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_between_pages_lands_on_a_page_and_heading(page):
    for target, anchor in re.findall(r"\]\((?!https?:)([^)#\s]*)(?:#([^)\s]+))?\)", text_of(page)):
        linked = (page.parent / target).resolve() if target else page
        assert linked.exists(), f"{page.name}: the link to {target} lands nowhere"
        if anchor:
            assert anchor in headings(linked), f"{page.name}: {target}#{anchor} names no heading of {linked.name}"


def headings(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them."""
    titles = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


def test_the_readme_is_a_front_door_and_links_every_page_of_docs():
    readme = text_of(PROJECT / "README.md")
    assert readme.count("\n") < 250, "the README grows past a front door: move the detail to a page of docs/"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert linked == {page.name for page in (PROJECT / "docs").glob("*.md")}


@pytest.mark.parametrize("path", sorted((PROJECT / "src" / PACKAGE).rglob("*.py")), ids=lambda path: path.name)
def test_every_module_the_code_tells_you_to_run_exists(path):
    """Docstrings and messages name commands too (a module once moved: `python -m PACKAGE.pack`)."""
    for module in set(re.findall(rf"python -m ({PACKAGE}(?:\.\w+)+)", path.read_text())):
        assert importlib.util.find_spec(module) is not None, f"{path.name}: python -m {module}: no such module"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_table_repeats_a_row(page):
    rows = [line for line in text_of(page).splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    repeated = {row[:80] for row in rows if rows.count(row) > 1}
    assert not repeated, f"{page.name}: rows written twice: {repeated}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_a_table_ends_before_the_text_after_it(page):
    """Markdown reads a line right under a table as one more row."""
    lines = re.sub(r"```.*?```", "", page.read_text(), flags=re.S).splitlines()
    for row, after in zip(lines, lines[1:], strict=False):  # each line with the next
        assert not (row.startswith("|") and after.strip() and not after.startswith("|")), f"{page.name}: {after!r}"


def test_training_md_gives_the_build_order_train_build_runs():
    """The loaders are built (and checked through the task) before the model is wrapped."""
    order = ["build_loaders", "check_task", "wrap(", "build_optimizer", "build_scheduler"]
    code = ast.get_source_segment(SOURCE_OF_TRAIN, function_named(SOURCE_OF_TRAIN, "build"))
    assert [code.index(step) for step in order] == sorted(code.index(step) for step in order)
    page = text_of(PROJECT / "docs" / "training.md")
    said = ["builds the loaders", "checks one batch", "wraps the model", "builds the optimizer", "the schedule"]
    assert [page.index(step) for step in said] == sorted(page.index(step) for step in said)


def test_training_md_names_what_decides_whether_a_micro_batch_reduces():
    """Under fsdp with parallel.reduce_every_micro_batch every micro-batch reduce-scatters: the page
    once said every strategy skipped the reduction on all but the last."""
    decides = {f"parallel.{name}" for name in re.findall(r"settings\.(\w+)", inspect.getsource(parallel.micro_batch))}
    page = " ".join(text_of(PROJECT / "docs" / "training.md").split())
    bullet = page.split("**Loss weighting and accumulation.**")[1].split("- **")[0]
    assert decides and all(f"`{setting}" in bullet for setting in decides), (decides, bullet)
    assert "no_sync" in bullet and "every rank and every micro-batch" in bullet


SOURCE_OF_TRAIN = Path(train.__file__).read_text()


def function_named(source: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_a_page_gives_the_smoke_checks_length_as_it_runs(page):
    steps = int(next(item.split("=")[1] for item in smoke.SMOKE_RUN if item.startswith("train.max_steps=")))
    text = " ".join(text_of(page).split())
    said = re.findall(r"smoke check[^.]*?\b(\d+) steps", text)
    if page.name == "README.md":  # its section on the smoke check
        said += re.findall(r"\b(\d+) steps", text.split("## Check it on this machine")[1].split("## ")[0])
    assert said or page.name != "README.md"
    for count in said:
        assert int(count) == steps, f"{page.name}: the smoke check runs {steps} steps, not {count}"


def test_the_scaling_bands_are_those_diagnose_prints():
    bands = re.findall(r"efficiency >= (0\.\d+)", Path(diagnose.__file__).read_text())
    line = next(
        line for line in text_of(PROJECT / "docs" / "observability.md").split("\n\n") if "Scaling efficiency" in line
    )
    assert bands and set(re.findall(r"\b0\.\d+", line)) == set(bands), (bands, line)


# pages another change rewrites now; each leaves this list once it reads in short sentences
SHORT_SENTENCES = 25  # words a sentence, on average over a page


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_page_reads_in_short_sentences(page):
    lengths = [len(sentence) for sentence in sentences(page.read_text())]
    mean = sum(lengths) / max(1, len(lengths))
    assert mean <= SHORT_SENTENCES, f"{page.name}: {mean:.1f} words a sentence on average; split the long ones"


def sentences(text: str) -> list[list[str]]:
    """The words of each sentence of a page's prose: not code blocks, tables or headings; a list
    item is a sentence of its own, and so is what a colon ends."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    blocks, current = [], []
    for line in [*text.splitlines(), ""]:
        line = line.strip()
        if not line or line.startswith(("|", "#")) or re.match(r"([-*]|\d+\.)\s", line):
            blocks.append(" ".join(current))
            current = []
        if line and not line.startswith(("|", "#")):
            current.append(re.sub(r"^([-*]|\d+\.)\s+", "", line))
    found = []
    for block in blocks:
        block = re.sub(r"`[^`]*`", lambda code: re.sub(r"[.!?:]", "_", code.group(0)), block)  # code is one word
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"*\[])|:\s*$", block):
            words = [word for word in sentence.split() if re.search(r"\w", word)]
            if words:
                found.append(words)
    return found
