"""A generated project follows its template: cruft create / check / update / link, and replay.

The cruft tests work on a git repository made from the template's working tree as it is now
(uncommitted edits included), so they test this checkout, not its last commit.
"""

import json
import os
import shutil
import stat
import subprocess
import sys

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


def sh(cwd, *command, check=True, stdin=None, text_output=True) -> subprocess.CompletedProcess:
    """Run a command; without `stdin` a prompt reads end-of-file instead of waiting for the test's terminal."""
    result = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=text_output,
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


# The last template commit before the package's modules moved into loop/ and base/ and the settings
# were regrouped by concern: a project made from it, with a run on disk, updates to today's template
PREVIOUS_LAYOUT = "35f31bedcc0d7077b24b5f369bc8192745bb3ee5"
USER_EDIT = ("nn.ReLU()", "nn.GELU()")  # the user's own change behind the seam


def template_history(tmp_path, first: str):
    """A repository whose first commit is the template at commit `first` (of this checkout's history)
    and whose second is the template's working tree now."""
    repo = tmp_path / "template"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    archive = sh(TEMPLATE, "git", "archive", "--format=tar", first, text_output=False).stdout
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive, check=True)
    old = commit_all(repo, "the template before")
    for path in repo.iterdir():
        if path.name != ".git":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    now = template_repo(tmp_path / "now")
    shutil.copytree(now, repo, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git"))
    return repo, old, commit_all(repo, "the template now")


def train(project, *overrides: str) -> subprocess.CompletedProcess:
    """One process, the tests' tiny run, as the project's own python would run it."""
    command = [sys.executable, "-m", "ddp_trainer.train", "--config", "configs/smoke.yaml", *overrides]
    env = os.environ | {"PYTHONPATH": str(project / "src"), "OMP_NUM_THREADS": "1"}
    quiet = ["run.tensorboard=false", "data.num_workers=0", "checkpoint.every_steps=4"]
    return subprocess.run([*command, *quiet], cwd=project, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(
    subprocess.run(["git", "-C", str(TEMPLATE), "cat-file", "-e", PREVIOUS_LAYOUT], capture_output=True).returncode,
    reason=f"needs the template's history back to {PREVIOUS_LAYOUT[:7]}: git fetch --unshallow",
)
def test_a_project_of_the_previous_layout_updates_keeps_the_users_edit_and_resumes_its_run(tmp_path):
    repo, old, now = template_history(tmp_path, PREVIOUS_LAYOUT)
    cruft(tmp_path, "create", repo, "--no-input", "--checkout", old, "--output-dir", tmp_path / "out")
    project = tmp_path / "out" / "ddp-trainer"
    start_history(project)
    model = project / "src" / "ddp_trainer" / "model.py"
    model.write_text(model.read_text().replace(*USER_EDIT))
    commit_all(project, "my activation")
    finished = train(project, "train.max_steps=4")
    assert finished.returncode == 0 and "done: 4 steps" in finished.stdout, finished.stderr[-3000:]

    cruft(project, "update", "--skip-apply-ask", "--checkout", now)
    assert not list(project.rglob("*.rej"))
    assert USER_EDIT[1] in model.read_text() and "from .base.rules import PositiveInt" in model.read_text()
    assert (project / "src" / "ddp_trainer" / "loop" / "checkpoint.py").exists()
    assert not (project / "src" / "ddp_trainer" / "checkpoint.py").exists()
    resumed = train(project, "train.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from runs/smoke/checkpoints/step_00000004.pt at step 4" in resumed.stdout
    assert "names settings as they were before their sections were regrouped" in resumed.stdout
    assert "done: 6 steps" in resumed.stdout
