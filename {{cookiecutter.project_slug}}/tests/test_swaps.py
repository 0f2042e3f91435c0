"""docs/your-model-and-data.md's swaps, done exactly as it says: copy an
example's seam files over src/<package>/, sync the config, then pass the smoke check (whose
2-rank run must learn) and keep the proofs of the distributed maths."""

import json
import math
import shutil
import subprocess
import sys
from collections import Counter

import pytest
from conftest import PACKAGE, PROJECT, project_env, read_metrics

SWAPS = {
    # example -> (main metric, how good it must get on the smoke run)
    "image_classifier": ("eval_accuracy", lambda value, _: value > 0.9),
    "language_model": ("eval_loss", lambda value, unigram: value < unigram - 0.15),
    "regression": ("eval_rmse", lambda value, _: value < 0.5),  # predicting zero gives about 0.67
    "detection": ("eval_map_50", lambda value, _: value > 0.05),  # untrained: 0.0
    "contrastive": ("eval_knn_accuracy", lambda value, _: value > 0.95),  # untrained: 0.81
}
NEEDS = {"detection": ("torchvision", "torchmetrics", "pycocotools")}  # pip install -e ".[detection]"


def swap(tmp_path, example: str):
    """A copy of this project with the example's seam files in place; the copy's own paths."""
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns("runs", ".venv", "__pycache__", "*.egg-info"))
    package = project / "src" / PACKAGE
    changed = sorted(p.name for p in (project / "examples" / example).glob("*.py"))
    for name in changed:
        shutil.copy(project / "examples" / example / name, package / name)
    env = project_env(PYTHONPATH=f"{package.parent}:{project / 'tests'}", CUDA_VISIBLE_DEVICES="")
    sync = [sys.executable, "-m", f"{PACKAGE}.config", "sync", "configs/default.yaml"]
    subprocess.run(sync, cwd=project, env=env, check=True, capture_output=True, timeout=60)
    return project, env, changed


def launch(project, env, *command, timeout=240):
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def torchrun(project, env, *args, nproc=2, timeout=240):
    return launch(project, env, sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={nproc}", *args, timeout=timeout)  # fmt: skip


def unigram_entropy(project, env) -> float:
    """Nats per byte of the language model's evaluation text under its own byte frequencies."""
    code = f"from {PACKAGE}.data import corpus; import sys; sys.stdout.buffer.write(corpus())"
    text = launch(project, env, sys.executable, "-c", code).stdout.encode("latin-1", "replace")
    counts = Counter(text)
    return -sum(n / len(text) * math.log(n / len(text)) for n in counts.values())


@pytest.mark.slow
@pytest.mark.parametrize("example", SWAPS)
def test_a_swap_of_the_seam_files_trains_passes_smoke_and_keeps_the_proofs(tmp_path, example):
    for module in NEEDS.get(example, ()):
        pytest.importorskip(module, reason=f'examples/{example} needs {module}: pip install -e ".[{example}]"')
    project, env, changed = swap(tmp_path, example)
    assert set(changed) <= {"model.py", "data.py", "task.py"}  # the seam files the README names

    # the smoke check on the tests' tiny run (configs/smoke.yaml: the swap's test-sized defaults),
    # 60 steps on 2 ranks and an evaluation at the end, whose metric must show it learned
    runs = tmp_path / "runs"
    smoke = ["bash", "scripts/smoke.sh", "--config", "configs/smoke.yaml", "train.max_steps=60", f"run.out_dir={runs}"]
    smoke = launch(project, env, *smoke)
    assert "smoke: PASS (0 failed" in smoke.stdout, smoke.stdout
    assert "eval step 60" in smoke.stdout
    metric, good_enough = SWAPS[example]
    final = [r for r in read_metrics(runs / "smoke-check") if metric in r][-1]
    baseline = unigram_entropy(project, env) if example == "language_model" else None
    assert good_enough(final[metric], baseline), (final, baseline)

    proofs = tmp_path / "proofs"
    proofs.mkdir()
    torchrun(project, env, "tests/dist_proofs.py", str(proofs))
    result = json.loads((proofs / "proofs-2.json").read_text())
    assert result["equivalence"]["gradient_error"] < 1e-5 and result["accumulation"]["gradient_error"] < 1e-5
    assert result["weighting"]["max_difference"] < 1e-6, result["weighting"]
