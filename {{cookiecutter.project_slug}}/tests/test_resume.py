"""Resuming, in the loop's own run in this process (a world of one, seconds, on the plain stand-in
task of tests/stand_ins.py as test_wiring.py's runs): with accumulation
the position in the epoch counts micro-batches, so a resume on the same layout is bit-identical and
one on another reads each sample of the epoch once; from a 2-rank checkpoint the global batch is
kept whatever data.batch_size is, or, with checkpoint.allow_new_global_batch, the peak lr follows
the new one by the scaling rule; the resume note lists only the settings the user changed.

A 2-rank checkpoint is made from a 1-rank run's (`as_written_by_two_ranks`): the checkpoint 2
ranks with half the per-device batch write after reading the same samples. Resuming a 2-rank run
for real takes torchrun: test_elastic.py's drill, and here each rank's generators (slow tier).
"""

import copy
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import CHECKPOINT_FORMATS, PROJECT, SMOKE_CONFIG, WORLD_OF_ONE, read_metrics, torchrun, train_args
from torch.utils.data import Dataset, Subset

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base import records
from {{ cookiecutter.package_name }}.base.batching import num_samples
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint, elastic, parallel, sharded_checkpoint

pytestmark = pytest.mark.usefixtures("plain_task")  # the loop's own behaviour, whatever the model


# exact and quick: fp32, no loader workers, no TensorBoard, every step logged
QUICK = ("run.tensorboard=false", "data.num_workers=0", "train.precision=fp32", "run.log_every=1")


class Read(Dataset):
    """A training set that notes each index the loop reads, epoch by epoch (no workers: in this process)."""

    def __init__(self, dataset: Dataset, reads: list):
        self.dataset, self.reads = dataset, reads

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.reads[-1].append(index)
        return self.dataset[index]


@dataclass
class Watched:
    """What the runs of a test did: the samples of each optimizer step's micro-batches, the
    indices each epoch read (one list per call of train_one_epoch), what they printed."""

    steps: list = field(default_factory=list)
    epochs: list = field(default_factory=lambda: [[]])  # the first: what the start-up checks read
    out: str = ""


@pytest.fixture
def run_here(tmp_path, process_settings, monkeypatch, capsys):
    """`run_here(name, *overrides)` runs train.run on the smoke config in this process, under
    tmp_path/name, with the first train.samples (default 48) of the task's training set and 8
    evaluation samples; returns (its config, what it did)."""
    train_step, one_epoch, build_datasets = train.train_step, train.train_one_epoch, task.build_datasets
    watched = Watched()
    samples = {"train": 48}

    def counted(job, micro_batches, cfg, info):
        watched.steps.append([num_samples(batch) for batch in micro_batches])
        return train_step(job, micro_batches, cfg, info)

    def epoch(*args):
        watched.epochs.append([])
        return one_epoch(*args)

    def datasets(cfg):
        train_set, eval_set = build_datasets(cfg)
        return Read(Subset(train_set, range(samples["train"])), watched.epochs), Subset(eval_set, range(8))

    monkeypatch.setattr(train, "train_step", counted)
    monkeypatch.setattr(train, "train_one_epoch", epoch)
    monkeypatch.setattr(task, "build_datasets", datasets)

    def train_run(name: str, *overrides: str, train_samples: int = 48) -> tuple[config.Config, Watched]:
        samples["train"] = train_samples
        watched.steps.clear()
        watched.epochs[:] = [[]]
        cfg = config.load(SMOKE_CONFIG, [f"run.out_dir={tmp_path / name}", *QUICK, *overrides])
        capsys.readouterr()
        assert train.run(cfg, WORLD_OF_ONE) == 0
        watched.out = capsys.readouterr().out
        return cfg, watched

    return train_run


def as_written_by_two_ranks(path: Path) -> None:
    """Make `path`, a checkpoint of a 1-rank run (a file, or a sharded one's directory, whose
    tensors any world size reads: its state.pt is changed), the one 2 ranks with half its per-device
    batch write after reading the same samples: b batches of B/2 on 2 ranks read the first b x B
    samples of the epoch's order, as b batches of B on 1 do (DistributedSampler's layout), so the
    global batch, the position in the epoch and the schedule are the same, the weights equal to
    float rounding (their BatchNorm statistics aside); each rank's generators are rank 0's."""
    path = path / sharded_checkpoint.STATE_FILE if path.is_dir() else path
    payload = torch.load(path, weights_only=True)
    assert payload["config"]["data"]["batch_size"] % 2 == 0
    payload["config"]["data"]["batch_size"] //= 2
    payload |= {"world_size": 2, "rng": payload["rng"] * 2}
    torch.save(payload, path)


class NoisyUnits:
    """A build_model whose model's units (parallel.units: the task's or the default ones) scale their
    output by a random factor drawn in their forward, as dropout draws its mask there; `scaled`
    counts the float tensors the noise reached."""

    def __init__(self, build_model):
        self.build_model, self.scaled = build_model, 0

    def __call__(self, cfg):
        model = self.build_model(cfg)
        for unit in parallel.units(model):
            forward = unit.forward
            unit.forward = lambda *args, forward=forward, **kwargs: self.noisy(forward(*args, **kwargs), torch.rand(()))
        return model

    def noisy(self, output, draw: torch.Tensor):
        """`output` with its float tensors scaled by 0.5 + `draw`, whatever holds them: a tuple (a
        recurrent layer's (outputs, state)), a list, a dict or a Hugging Face ModelOutput."""
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            self.scaled += 1
            return output * (0.5 + draw)
        if isinstance(output, tuple | list):
            parts = [self.noisy(part, draw) for part in output]
            return output._make(parts) if hasattr(output, "_make") else type(output)(parts)
        if isinstance(output, dict):
            result = copy.copy(output)
            for key, value in output.items():
                result[key] = self.noisy(value, draw)
            return result
        return output


def lrs(cfg: config.Config) -> dict[int, float]:
    """{step: the lr logged after it} of the run's metrics.jsonl."""
    return {r["step"]: r["lr"] for r in records.of_kind(read_metrics(cfg.run_dir), records.TRAIN)}


def weights_and_moments(path: Path) -> tuple[dict, dict]:
    payload = checkpoint.load_file(path)
    return payload["model"], payload["optimizer"]["state"]


@pytest.mark.parametrize(
    "accum, recompute", [(2, "none"), (4, "none"), (2, "full")], ids=["accum2", "accum4", "accum2-recompute"]
)
def test_a_run_with_accumulation_killed_mid_epoch_resumes_bit_identical(run_here, monkeypatch, accum, recompute):
    # 3 steps an epoch; checkpoints at 2, 4 and the end, 5: killed after step 2's (mid-epoch 0), the
    # resumed run crosses into epoch 1 and must end where the uninterrupted one ended
    noisy = NoisyUnits(task.build_model)
    if recompute != "none":  # recomputed units that draw random numbers in their forward, as dropout does
        monkeypatch.setattr(task, "build_model", noisy)
    settings = (f"train.grad_accum_steps={accum}", "data.batch_size=2", "train.max_steps=5")
    settings += ("checkpoint.every_steps=2", f"parallel.activation_checkpointing={recompute}")
    cfg, _ = run_here("run", *settings, train_samples=6 * accum)
    run_dir = cfg.run_dir
    uninterrupted = weights_and_moments(run_dir.checkpoint(5))
    for step in (4, 5):
        run_dir.checkpoint(step).unlink()
    _, watched = run_here("run", *settings, train_samples=6 * accum)
    assert "step_00000002.pt at step 2" in watched.out
    assert watched.steps == [[2] * accum] * 3  # steps 3 to 5, each of `accum` micro-batches
    resumed = weights_and_moments(run_dir.checkpoint(5))
    if recompute != "none":
        assert noisy.scaled, "the units' outputs hold no float tensor (nor tuple, list or dict of them) to add noise to"
    for ours, theirs in zip(resumed, uninterrupted, strict=True):
        assert ours.keys() == theirs.keys()
        for name in theirs:
            theirs_value = theirs[name]
            if isinstance(theirs_value, dict):  # the optimizer's state of one parameter
                assert all(torch.equal(ours[name][key], theirs_value[key]) for key in theirs_value), name
            else:
                assert torch.equal(ours[name], theirs_value), name


NOISY = str(PROJECT / "tests" / "noisy_train.py")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_a_2_rank_run_whose_forward_draws_random_numbers_resumes_bit_identical_on_each_ranks_generators(tmp_path, fmt):
    # checkpoints at 2, 4 and the end, 5, on 2 ranks whose units draw a random number each forward
    # from their own generator (as dropout draws its mask): the rerun without 4 and 5 resumes at 2
    # and must end where the uninterrupted run ended; a rank given another rank's generators, or
    # fresh ones, draws other numbers (in a world of one only rank 0's exist)
    settings = ("data.num_workers=0", "train.max_steps=5", "checkpoint.every_steps=2", f"checkpoint.format={fmt}")
    torchrun(NOISY, *train_args(tmp_path, *settings)[2:], timeout=180)
    run_dir = RunDir(tmp_path / "smoke")
    uninterrupted = checkpoint.find(run_dir.checkpoint(5, sharded=fmt == "sharded"))[1]["model"]
    for later in run_dir.saved_checkpoints()[-2:]:  # steps 4 and 5
        if later.is_dir():
            shutil.rmtree(later)
        else:
            later.unlink()
    resumed = torchrun(NOISY, *train_args(tmp_path, *settings)[2:], timeout=180)
    assert "at step 2" in resumed.stdout, resumed.stdout
    ours = checkpoint.find(run_dir.checkpoint(5, sharded=fmt == "sharded"))[1]["model"]
    assert ours.keys() == uninterrupted.keys()
    assert all(torch.equal(ours[name], uninterrupted[name]) for name in ours), "the resumed run drew other numbers"


def test_a_checkpoint_with_accumulation_resumed_on_another_world_size_reads_the_rest_of_its_epoch_once(run_here):
    # 2 ranks x batch 2 x accum 2 read 1 step (8 samples) of an epoch of 24; on 1 rank with
    # data.batch_size=2 the global batch 8 is kept as batch 2 x accum 4, and the epoch goes on
    # with the 16 samples it has not read
    accumulated = ("train.grad_accum_steps=2",)  # the user's setting, on either world size
    cfg, before = run_here("run", "data.batch_size=4", *accumulated, "train.max_steps=1", train_samples=24)
    first = list(before.epochs[1])
    as_written_by_two_ranks(cfg.run_dir.checkpoint(1))
    _, after = run_here("run", "data.batch_size=2", *accumulated, "train.max_steps=3", train_samples=24)
    assert "resumed on 1 rank from a 2-rank checkpoint: batch 2 x 1 x accum 4 keeps the global batch 8" in after.out
    rest = after.epochs[1]
    assert len(first) == 8 and len(rest) == 16 and sorted(first + rest) == list(range(24))
    assert after.steps == [[2] * 4] * 2


@pytest.mark.parametrize("batch_size", [8, 3])
def test_a_2_rank_checkpoint_of_2_x_10_resumed_on_1_rank_runs_20_samples_a_step_whatever_data_batch_size(
    run_here, batch_size
):
    cfg, _ = run_here("run", "data.batch_size=20", "train.max_steps=1")
    as_written_by_two_ranks(cfg.run_dir.checkpoint(1))
    _, watched = run_here("run", f"data.batch_size={batch_size}", "train.max_steps=2")
    assert len(watched.steps) == 1 and sum(watched.steps[0]) == 20, watched.steps  # never 18 or 16
    micro, accum = watched.steps[0][0], len(watched.steps[0])
    assert micro <= batch_size and micro == max(b for b in range(1, batch_size + 1) if 20 % b == 0)
    assert f"batch {micro} x 1 x accum {accum} keeps the global batch 20" in watched.out
    # data.batch_size is the user's change; the accumulation the split chose is not
    assert f"data.batch_size 10 -> {batch_size}" in watched.out and "train.grad_accum_steps" not in watched.out


def linear_schedule(step: int) -> float:
    """The lr of step `step` + 1 over the peak: 3 warmup steps of 8, then linear decay to 0.1."""
    return (step + 1) / 4 if step < 3 else 1 - 0.9 * (step - 3) / 5


@pytest.mark.parametrize("rule, ratio", [("linear", 2.0), ("sqrt", 2.0**0.5)])
def test_a_new_global_batch_allowed_on_another_world_size_moves_the_peak_lr_by_the_scaling_rule(run_here, rule, ratio):
    # a 2-rank run of global batch 4 (2 x batch 2), tuned at 4, resumed after step 1, inside the
    # warmup, on 1 rank with batch 8: twice the global batch, so the lr of every later step,
    # through warmup and decay, is x 2 (linear) or x 1.41 (sqrt) the schedule's
    schedule = (f"optim.lr_scaling={rule}", "optim.reference_batch_size=4", "schedule.warmup_fraction=0.375")
    schedule += ("schedule.name=linear", "schedule.min_lr_ratio=0.1")
    cfg, _ = run_here("run", "data.batch_size=4", "train.max_steps=1", *schedule)
    as_written_by_two_ranks(cfg.run_dir.checkpoint(1))
    allowed = ("data.batch_size=8", "checkpoint.allow_new_global_batch=true", "train.max_steps=8")
    resumed, watched = run_here("run", *allowed, *schedule)
    moved = "the global batch goes from 4 to 8 = batch 8 x 1 x accum 1 (checkpoint.allow_new_global_batch)"
    assert moved in watched.out and "the lr rescaled by optim.lr_scaling" in watched.out
    peak = cfg.optim.lr * ratio
    assert f"lr {peak:.3g}: optim.lr {cfg.optim.lr:g} tuned at batch 4, scaled {rule}" in watched.out
    logged = lrs(resumed)  # after step s: the lr of step s + 1
    assert sorted(logged) == list(range(1, 9))  # step 1's record is the first run's, at its own peak
    assert [logged[step] for step in range(2, 9)] == pytest.approx([peak * linear_schedule(s) for s in range(2, 9)])


def split_noted(out: str) -> bool:
    """Whether the resume note lists the per-device batch or the accumulation as changed."""
    return any(f"{name} " in line for line in out.splitlines() if "settings changed" in line for name in SPLIT)


SPLIT = ("data.batch_size", "train.grad_accum_steps")


@pytest.mark.parametrize("fmt", CHECKPOINT_FORMATS)
def test_a_split_chosen_for_another_world_size_is_kept_by_a_restart_and_never_listed_as_a_change(run_here, capsys, fmt):
    # 2 ranks x batch 2 (global 4); the user's settings never change: data.batch_size=2, accum 1;
    # the settings as given travel in either checkpoint format (a sharded one's state.pt)
    form = f"checkpoint.format={fmt}"
    cfg, _ = run_here("run", "data.batch_size=4", "train.max_steps=1", form)
    as_written_by_two_ranks(cfg.run_dir.checkpoint(1, sharded=fmt == "sharded"))
    _, on_one = run_here("run", "data.batch_size=2", "train.max_steps=2", form)  # an elastic restart on 1 rank
    assert "batch 2 x 1 x accum 2 keeps the global batch 4" in on_one.out and not split_noted(on_one.out)
    # torchrun restarts it on that 1 rank again: the global batch stays 4, nothing is listed as changed
    cfg, again = run_here("run", "data.batch_size=2", "train.max_steps=3", form)
    assert again.steps == [[2, 2]] and not split_noted(again.out)
    assert "batch 2 x 1 x accum 2 keeps the global batch 4" in again.out
    # ... and back on 2 ranks, as train_and_save resumes there (its collectives aside): batch 2 x 2 ranks
    path = cfg.run_dir.checkpoint(3, sharded=fmt == "sharded")
    payload = checkpoint.load_file(path)
    given = [f"run.out_dir={cfg.run.out_dir}", *QUICK, "data.batch_size=2", "train.max_steps=3", form]
    asked = config.load(SMOKE_CONFIG, given)
    on_two, line = elastic.keep_global_batch(asked, payload, 2)
    assert (on_two.data.batch_size, on_two.train.grad_accum_steps) == (2, 1) and "global batch 4" in line
    rank_0_of_2 = DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo")
    job = train.build(on_two, WORLD_OF_ONE)
    capsys.readouterr()
    settings = config.to_dict(on_two)
    checkpoint.restore(job.model, job.state, path, payload, rank_0_of_2, settings, config.to_dict(asked))
    assert capsys.readouterr().out == ""
    # a setting the user did change is still named, and only it
    changed = config.load(SMOKE_CONFIG, [*given, "optim.lr=0.5"])
    checkpoint.restore(job.model, job.state, path, payload, rank_0_of_2, settings, config.to_dict(changed))
    note = capsys.readouterr().out
    assert "settings changed since it was written: optim.lr " in note and "grad_accum_steps" not in note
