"""A generated project follows its template: cruft create / check / update / link, and replay.

The cruft tests work on a git repository made from the template's working tree as it is now
(uncommitted edits included), so they test this checkout, not its last commit.
"""

import json
import stat
import subprocess

import pytest
from conftest import BIN, TEMPLATE, bake

PROJECT_DIR = "{{cookiecutter.project_slug}}"  # the template's project folder, as named in its repository
SEAM = PROJECT_DIR + "/src/{{cookiecutter.package_name}}/model.py"  # part of the task seam
TEMPLATE_LINE = "# a line the template added after the project was made\n"
USER_CODE = "\n\ndef my_head(width: int) -> nn.Module:\n    return nn.Linear(width, 3)  # the user's own code\n"
SLURM_AND_LICENSE = ["scripts/train.sbatch", "tests/test_sbatch.py", "LICENSE"]


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    """cookiecutter's replay and clone folders and git's settings stay inside the test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Template Test")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "test@example.invalid")


def sh(cwd, *command, check=True, stdin=None) -> subprocess.CompletedProcess:
    """Run a command; without `stdin` a prompt reads end-of-file instead of waiting for the test's terminal."""
    result = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def git(cwd, *args) -> str:
    return sh(cwd, "git", *args).stdout.strip()


def cruft(cwd, *args, check=True, stdin=None) -> subprocess.CompletedProcess:
    return sh(cwd, BIN / "cruft", *args, check=check, stdin=stdin)


def commit_all(repo, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def template_repo(tmp_path):
    """The template's working tree (what git would commit from it) in a fresh repository."""
    repo = tmp_path / "template"
    listed = sh(TEMPLATE, "git", "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout
    for name in filter(None, listed.split("\0")):
        source = TEMPLATE / name
        if source.is_file():  # a tracked file deleted from the working tree is still listed
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_bytes(source.read_bytes())
            (repo / name).chmod(source.stat().st_mode)
    git(repo, "init", "-q", "-b", "main")
    commit_all(repo, "the template under test")
    return repo


def append(path, text: str) -> None:
    path.write_text(path.read_text() + text)


def start_history(project) -> None:
    """cruft update merges into a clean git work tree, as a user's project is."""
    git(project, "init", "-q", "-b", "main")
    commit_all(project, "generated")


def cruft_check(project) -> str:
    result = cruft(project, "check", check=False)
    return "up to date" if result.returncode == 0 else "behind" if "out of date" in result.stdout else result.stdout


def files_with_contents(root) -> dict:
    return {
        str(p.relative_to(root)): (stat.S_IMODE(p.stat().st_mode), p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_cruft_update_brings_template_changes_and_keeps_the_users_edits(tmp_path):
    repo = template_repo(tmp_path)
    cruft(tmp_path, "create", repo, "--no-input", "--output-dir", tmp_path / "out")
    project = tmp_path / "out" / "ddp-trainer"
    start_history(project)
    model = project / "src" / "ddp_trainer" / "model.py"
    append(model, USER_CODE)  # the user works behind the seam
    commit_all(project, "my head")
    assert cruft_check(project) == "up to date"

    seam = repo / SEAM
    seam.write_text(TEMPLATE_LINE + seam.read_text())
    append(repo / PROJECT_DIR / "scripts" / "train.sh", "# a comment the template added\n")
    new_commit = commit_all(repo, "template change")
    assert cruft_check(project) == "behind"

    cruft(project, "update", "--skip-apply-ask")
    assert model.read_text().startswith(TEMPLATE_LINE) and model.read_text().endswith(USER_CODE)
    assert (project / "scripts" / "train.sh").read_text().endswith("# a comment the template added\n")
    assert not list(project.rglob("*.rej"))
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new_commit
    assert json.loads((project / ".cookiecutter.json").read_text())["template_commit"] == new_commit
    assert cruft_check(project) == "up to date"


@pytest.mark.slow
def test_an_update_keeps_the_files_the_answers_pruned(tmp_path):
    """cruft re-runs the post-gen hook on both renders it diffs, so pruned files never come back:
    neither changed ones nor one the template adds later to a pruned option's row of the table."""
    repo = template_repo(tmp_path)
    answers = json.dumps({"slurm": False, "license": "none"})
    cruft(tmp_path, "create", repo, "--no-input", "--extra-context", answers, "--output-dir", tmp_path / "out")
    project = tmp_path / "out" / "ddp-trainer"
    assert not any((project / name).exists() for name in SLURM_AND_LICENSE)
    start_history(project)

    for name in SLURM_AND_LICENSE:
        append(repo / PROJECT_DIR / name, "# changed by the template\n")
    (repo / PROJECT_DIR / "scripts" / "requeue.sbatch").write_text("#!/bin/bash\n# a new SLURM helper\n")
    hook = repo / "hooks" / "post_gen_project.py"
    table_row = '"tests/test_sbatch.py"]'
    assert hook.read_text().count(table_row) == 1, "the SLURM row of OPTIONAL_FILES changed: update this test"
    hook.write_text(hook.read_text().replace(table_row, '"tests/test_sbatch.py", "scripts/requeue.sbatch"]'))
    append(repo / PROJECT_DIR / "scripts" / "train.sh", "# a comment the template added\n")
    commit_all(repo, "template change")

    cruft(project, "update", "--skip-apply-ask")
    assert (project / "scripts" / "train.sh").read_text().endswith("# a comment the template added\n")
    for name in [*SLURM_AND_LICENSE, "scripts/requeue.sbatch"]:
        assert not (project / name).exists(), f"{name} came back"
    assert not list(project.rglob("*.rej"))


@pytest.mark.slow
def test_a_plain_cookiecutter_project_carries_what_cruft_link_needs(tmp_path):
    repo = template_repo(tmp_path)
    sh(tmp_path, BIN / "cookiecutter", repo, "--no-input", "slurm=false", "-o", tmp_path / "out")
    project = tmp_path / "out" / "ddp-trainer"
    record = json.loads((project / ".cookiecutter.json").read_text())
    assert record["template_commit"] == git(repo, "rev-parse", "HEAD")
    start_history(project)
    answers = json.dumps(record["cookiecutter"])
    cruft(project, "link", repo, "--no-input", "--checkout", record["template_commit"], "--extra-context", answers)
    commit_all(project, "linked")
    assert cruft_check(project) == "up to date"

    append(repo / PROJECT_DIR / "scripts" / "train.sh", "# a comment the template added\n")
    commit_all(repo, "template change")
    assert cruft_check(project) == "behind"
    cruft(project, "update", "--skip-apply-ask")
    assert (project / "scripts" / "train.sh").read_text().endswith("# a comment the template added\n")
    assert not (project / "scripts" / "train.sbatch").exists()
    assert not list(project.rglob("*.rej"))
    assert cruft_check(project) == "up to date"


@pytest.mark.slow
def test_cruft_create_prompts_and_validates_like_cookiecutter(tmp_path):
    repo = template_repo(tmp_path)
    made = cruft(tmp_path, "create", repo, "--output-dir", tmp_path / "out", stdin="Image Classifier\n" + "\n" * 20)
    assert "global batch on 8 GPU(s)" in made.stdout  # the post-gen hook's summary
    assert (tmp_path / "out" / "image-classifier" / "src" / "image_classifier" / "train.py").exists()
    bad = ["--no-input", "--extra-context", json.dumps({"gpus_per_node": "0"}), "--output-dir", tmp_path / "bad"]
    refused = cruft(tmp_path, "create", repo, *bad, check=False)
    assert refused.returncode != 0
    assert "error: gpus_per_node 0 is out of range: use 1 to 64" in refused.stderr
    assert not (tmp_path / "bad" / "ddp-trainer").exists()


def test_replaying_the_recorded_answers_reproduces_the_project_byte_for_byte(tmp_path):
    answers = {"project_name": "Vision Net", "precision": "fp16", "compile": True, "grad_accum_steps": "2"}
    project = bake(tmp_path / "first", **answers, gpus_per_node="4", slurm=False, license="none")
    replay = ["--replay-file", project / ".cookiecutter.json", TEMPLATE, "-o", tmp_path / "again"]
    sh(tmp_path, BIN / "cookiecutter", *replay)  # a question left to ask would read end-of-file and fail
    first, second = files_with_contents(project), files_with_contents(tmp_path / "again" / "vision-net")
    assert sorted(second) == sorted(first)
    assert [name for name in first if first[name] != second[name]] == []  # same bytes, same modes
    assert "precision: fp16" in (tmp_path / "again" / "vision-net" / "configs" / "default.yaml").read_text()
