"""Samplers, per-epoch order, equal lengths, per-rank worker sizing, batch plumbing."""

import contextlib
import functools
import pickle
import random

import numpy as np
import pytest
import torch
from conftest import SMOKE_CONFIG
from torch.utils.data import Dataset, DistributedSampler, Subset

from {{ cookiecutter.package_name }} import config, task, train
from {{ cookiecutter.package_name }}.base import batching, cpus
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import loaders, preflight
from {{ cookiecutter.package_name }}.loop.callbacks import Run
from {{ cookiecutter.package_name }}.loop.samplers import EvalBatches
from {{ cookiecutter.package_name }}.loop.state import TrainState
from {{ cookiecutter.package_name }}.model import build_model


def info(rank=0, world=2, local_world=2):
    return DistInfo(rank, rank, world, local_world, torch.device("cpu"), "gloo")


@pytest.mark.parametrize(
    ("cpus", "local_ranks", "cap", "expected"),
    [(64, 8, 16, 7), (128, 8, 8, 8), (16, 8, 8, 1), (8, 8, 8, 0), (2, 2, 8, 0), (4, 1, 8, 3), (1, 4, 8, 0)],
)
def test_workers_per_rank_rule(cpus, local_ranks, cap, expected):
    # CPUs shared by the ranks of a node, one CPU left for each rank's main process, capped
    assert loaders.workers_per_rank(cpus, local_ranks, cap) == expected


def test_a_users_omp_num_threads_wins_over_the_cpu_share():
    assert cpus.threads_per_rank({}, 8, usable=16) == 2 and cpus.threads_per_rank({}, 32, usable=16) == 1
    assert cpus.threads_per_rank({"OMP_NUM_THREADS": "5"}, 8, usable=16) == 5


def train_size() -> int:
    return len(task.build_datasets(config.load(SMOKE_CONFIG))[0])


def build(rank, world, *overrides, workers=0, train_samples=None):
    cfg = config.load(SMOKE_CONFIG, [*overrides])
    train_set, eval_set = task.build_datasets(cfg)
    if train_samples is not None:
        train_set = Subset(train_set, range(train_samples))
    return loaders.build_loaders(train_set, eval_set, cfg, info(rank, world), workers)


class Draws(Dataset):
    """Randomness a dataset draws for itself, outside SeededSamples: an augmentation in __getitem__."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(())


def test_each_ranks_loader_workers_draw_their_own_random_numbers():
    data = config.load(SMOKE_CONFIG, ["data.worker_start=fork"]).data
    shared = [loaders.common(data, 0, info(rank, 2), 1) | {"collate_fn": None} for rank in range(2)]  # not the task's
    draws = [next(iter(torch.utils.data.DataLoader(Draws(), batch_size=8, **each))) for each in shared]
    assert not torch.equal(*draws)  # one base seed on every rank: the same augmentation on every rank's samples


def test_samplers_and_loader_settings():
    train, evaluation = build(0, 2)
    assert isinstance(train.sampler, DistributedSampler) and train.sampler.shuffle and train.sampler.drop_last
    assert train.drop_last  # drop_last on sampler and loader
    assert isinstance(evaluation.batch_sampler, EvalBatches)  # every sample once, batches alike on any world size
    first = min(config.load(SMOKE_CONFIG).data.batch_size, evaluation.batch_sampler.size)
    assert evaluation.batch_sampler.plan[0] == (list(range(first)), False)  # rank 0: the set's first batch
    assert not train.pin_memory  # CPU: nothing to pin
    train, _ = build(0, 2, "data.prefetch_factor=3", workers=2)  # not the default 2
    assert train.num_workers == 2 and train.persistent_workers and train.prefetch_factor == 3


@pytest.mark.parametrize(
    ("version", "hangs"),
    [((3, 10, 12), True), ((3, 10, 15), False), ((3, 11, 7), True), ((3, 11, 10), False), ((3, 12, 0), False)],
)
def test_fork_can_hang_on_the_pythons_before_the_fix_of_cpython_gh_112275(version, hangs):
    assert loaders.fork_can_hang(version) == hangs


def test_loader_workers_start_as_data_worker_start_says(monkeypatch):
    for start in ("fork", "forkserver", "spawn"):
        train, evaluation = build(0, 2, f"data.worker_start={start}", workers=2)
        assert train.multiprocessing_context.get_start_method() == start
        assert evaluation.multiprocessing_context.get_start_method() == start
        assert loaders.describe_workers(train) == f"2, started by {start}"
    cfg = config.load(SMOKE_CONFIG)
    monkeypatch.setattr(loaders.sys, "platform", "linux")
    for hangs, started in ((False, None), (True, "forkserver")):  # auto: fork, Linux's default, unless it can hang
        monkeypatch.setattr(loaders, "fork_can_hang", lambda hangs=hangs: hangs)
        train, _ = build(0, 2, workers=2)
        assert (train.multiprocessing_context.get_start_method() if hangs else train.multiprocessing_context) == started
        assert (loaders.worker_start_note(cfg.data, train) is not None) == hangs  # start-up says why
    assert build(0, 2, "data.worker_start=spawn")[0].multiprocessing_context is None  # no workers: nothing starts


class WithALambda(Dataset):
    def __init__(self, dataset: Dataset):
        self.dataset, self.transform = dataset, lambda sample: sample

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.transform(self.dataset[index])


def test_a_dataset_that_does_not_pickle_for_its_workers_is_one_line_naming_the_way_out():
    train_set, eval_set = task.build_datasets(config.load(SMOKE_CONFIG))
    for start in ("forkserver", "spawn", "fork"):
        cfg = config.load(SMOKE_CONFIG, [f"data.worker_start={start}"])
        for dataset in (train_set, WithALambda(train_set)):  # the task's tensors pickle (their data is not copied)
            train_loader, eval_loader = loaders.build_loaders(dataset, eval_set, cfg, info(0, 2), num_workers=2)
            check = functools.partial(preflight.check_task, build_model(cfg), (dataset, train_loader))
            if dataset is train_set or start == "fork":  # fork shares the dataset: nothing to pickle
                check((eval_set, eval_loader))
                continue
            with pytest.raises(preflight.TaskError, match="the train set does not pickle") as failed:
                check((eval_set, eval_loader))
            assert f"start by {start}" in str(failed.value) and str(failed.value).endswith("data.worker_start=fork")


@pytest.mark.slow
def test_forkserver_workers_load_the_batches_forked_workers_load():
    """The datasets reach a forkserver's workers pickled: the same batches, in the same order."""
    batches = {}
    for start in ("fork", "forkserver"):
        train, evaluation = build(0, 2, f"data.worker_start={start}", workers=2)
        train.sampler.set_epoch(1)
        batches[start] = [batch for loader in (train, evaluation) for batch in loader]
    assert len(batches["fork"]) == len(batches["forkserver"])
    for forked, served in zip(batches["fork"], batches["forkserver"], strict=True):
        torch.testing.assert_close(forked, served, rtol=0, atol=0)


class EpochAugmented(Dataset):
    """A training set augmented per epoch, as the image starter's is: sample i of epoch e is [i, e].
    It keeps the epoch in shared memory, where set_epoch reaches loader workers already started."""

    def __init__(self, size: int):
        self.size, self.epoch = size, torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, int(self.epoch)])


def persistent_loader(start: str, monkeypatch):
    cfg = config.load(SMOKE_CONFIG, [f"data.worker_start={start}", "data.batch_size=4"])
    monkeypatch.delattr(task, "collate", raising=False)  # the test's own samples: torch's default collate
    train_loader, _ = loaders.build_loaders(EpochAugmented(32), EpochAugmented(4), cfg, info(0, 1, 1), num_workers=1)
    assert train_loader.persistent_workers
    return cfg, train_loader


@pytest.mark.parametrize(
    "start",
    ["fork", pytest.param("forkserver", marks=pytest.mark.slow), pytest.param("spawn", marks=pytest.mark.slow)],
)
def test_a_persistent_workers_batch_in_epoch_1_is_a_fresh_loaders_epoch_1_batch(start, monkeypatch):
    # the loop's own epochs (train.fit), each reading one batch; the workers start in epoch 0 and
    # live on: set_epoch must reach them, whatever started them (fork: the default on Python 3.12+)
    cfg, loader = persistent_loader(start, monkeypatch)
    first_batches = []

    def one_batch(job, cfg, info, log, stop):
        first_batches.append(next(iter(job.train_loader)))
        job.state.step += 1
        return train.Outcome.EPOCH_END

    monkeypatch.setattr(train, "train_one_epoch", one_batch)
    monkeypatch.setattr(train, "run_evaluation", lambda *args: None)
    state = TrainState(None, None, None)
    run = Run(None, state, None, None, 2)
    job = train.Job(
        model=None,
        state=state,
        run=run,
        train_loader=loader,
        eval_loader=None,
        total_steps=2,
        global_batch=4,
        clock=None,
    )
    train.fit(job, cfg, info(0, 1, 1), log=None, stop=None)
    _, fresh = persistent_loader("fork", monkeypatch)  # started in epoch 1: the reference, whatever starts the workers
    fresh.sampler.set_epoch(1)
    fresh.dataset.set_epoch(1)
    assert first_batches[0][:, 1].tolist() == [0] * 4 and torch.equal(first_batches[1], next(iter(fresh)))


def test_cuda_loaders_pin_memory_for_non_blocking_copies():
    cfg = config.load(SMOKE_CONFIG)
    cuda_info = DistInfo(0, 0, 2, 2, torch.device("cuda", 0), "nccl")
    train, evaluation = loaders.build_loaders(*task.build_datasets(cfg), cfg, cuda_info, 0)  # pinned: async copies
    assert train.pin_memory and evaluation.pin_memory


def epoch_order(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return list(loader.sampler)


def test_set_epoch_changes_the_order_and_shards_are_disjoint():
    first, second = build(0, 2)[0], build(1, 2)[0]
    assert epoch_order(first, 0) != epoch_order(first, 1)  # set_epoch
    assert epoch_order(first, 0) == epoch_order(build(0, 2)[0], 0)  # reproducible
    assert not set(epoch_order(first, 3)) & set(epoch_order(second, 3))


@pytest.mark.parametrize("short", [0, 1, 99])
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_number_of_full_batches(short, world):
    size = max(world * 16, train_size() - short)  # the task's training set, a sample or a batch and more short
    lengths = {len(build(r, world, "data.batch_size=16", train_samples=size)[0]) for r in range(world)}
    assert len(lengths) == 1
    loader = build(world - 1, world, "data.batch_size=16", train_samples=size)[0]
    assert {len(indices) for indices in loader.batch_sampler} == {16}


def test_resumable_sampler_continues_mid_epoch():
    loader = build(1, 2)[0]
    full = epoch_order(loader, 5)
    skip = len(full) // 2  # half of this rank's share read before the stop
    loader.sampler.set_epoch(5)
    loader.sampler.skip = skip
    assert list(loader.sampler) == full[skip:] and len(loader) == (len(full) - skip) // loader.batch_size
    loader.sampler.set_epoch(6)
    assert loader.sampler.skip == 0


def test_unequal_lengths_fail_clearly_in_a_world_of_one():
    loaders.check_equal_lengths(10, info(0, 1, 1))
    with pytest.raises(RuntimeError, match="loader is empty"):
        loaders.check_equal_lengths(0, info(0, 1, 1))


def test_move_to_walks_tuples_lists_and_dicts():
    batch = {"ids": torch.ones(2, 3), "pair": (torch.zeros(2), [torch.ones(2)]), "name": "x"}
    moved = batching.move_to(batch, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
    assert isinstance(moved["pair"], tuple) and moved["name"] == "x"


def test_num_samples_and_describe_read_any_batch_structure():
    batch = {"meta": "x", "input_ids": torch.zeros(4, 7, dtype=torch.long), "labels": torch.zeros(4, 7)}
    assert batching.num_samples(batch) == 4 and batching.num_samples((torch.zeros(3, 2), torch.zeros(3))) == 3
    assert batching.describe(batch) == "{'meta': str, 'input_ids': Tensor[4, 7] int64, 'labels': Tensor[4, 7] float32}"


def leaves(batch) -> list:
    if isinstance(batch, dict):
        return [leaf for item in batch.values() for leaf in leaves(item)]
    if isinstance(batch, (list, tuple)):
        return [leaf for item in batch for leaf in leaves(item)]
    return [batch]


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_a_training_sample_reads_the_same_every_time_and_the_same_in_any_process():
    """The proofs read samples again, and a resumed run reads its epoch's rest again."""
    train_set, _ = task.build_datasets(config.load(SMOKE_CONFIG))
    index = len(train_set) // 2
    reads = [train_set[index], train_set[index]]
    torch.manual_seed(12345)  # whatever the process drew before
    reads.append(train_set[index])
    with contextlib.suppress(Exception):  # a loader worker's copy, where the dataset pickles (forked: no need)
        reads.append(pickle.loads(pickle.dumps(train_set))[index])
    for read in reads[1:]:
        assert all(same(a, b) for a, b in zip(leaves(reads[0]), leaves(read), strict=True)), (
            f"training sample {index} reads differently each time: draw its random augmentation through "
            "base.batching.SeededSamples (docs/your-model-and-data.md, Randomness)"
        )


class Drawn(Dataset):
    """Sample i: what torch's, numpy's and Python's global generators give, as an augmentation draws."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple:
        return torch.rand(()).item(), float(np.random.rand()), random.random()


def test_seeded_samples_draw_from_the_seed_epoch_and_index_and_leave_the_process_generators_alone():
    seeded = batching.SeededSamples(Drawn(), seed=7)
    torch.manual_seed(0)
    state = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    first = seeded[3]
    assert torch.equal(torch.get_rng_state(), state[0]) and (np.random.get_state()[1] == state[1]).all()
    assert random.getstate() == state[2]  # the process's own streams: untouched
    assert seeded[3] == first and seeded[4] != first  # the same every read; another sample, other draws
    assert seeded.epoch.is_shared()  # set_epoch reaches persistent loader workers however they start
    seeded.set_epoch(1)
    assert seeded[3] != first  # a new epoch draws anew
    assert batching.SeededSamples(Drawn(), seed=8)[3] != first


def test_seeded_draws_of_one_seed_and_epoch_are_no_other_seeds_at_another_epoch():
    # (seed, epoch, index), not (seed + epoch, index): run seed 8 must not repeat seed 7's draws an epoch later
    draws = {}
    for seed in (7, 8):
        seeded = batching.SeededSamples(Drawn(), seed=seed)
        for epoch in (0, 1, 2):
            seeded.set_epoch(epoch)
            draws[seed, epoch] = [seeded[index] for index in range(len(seeded))]
    assert len({tuple(map(tuple, epoch_draws)) for epoch_draws in draws.values()}) == len(draws)


class Curriculum(Drawn):
    """A dataset of the user's that follows the epoch itself (a curriculum, an augmentation's magnitude)."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_a_seeded_datasets_own_set_epoch_hears_every_epoch():
    curriculum = Curriculum()
    seeded = batching.SeededSamples(curriculum, seed=7)
    for epoch in (1, 2, 5):
        seeded.set_epoch(epoch)
        assert curriculum.epoch == epoch


def test_first_samples_collate_like_the_loader_without_touching_the_sampler():
    train, _ = build(0, 2)
    order = epoch_order(train, 0)
    batch = batching.first_samples(train.dataset, train, 3)
    expected = train.collate_fn([train.dataset[i] for i in range(3)])
    assert batching.describe(batch) == batching.describe(expected)
    assert all(same(a, b) for a, b in zip(leaves(batch), leaves(expected), strict=True))
    assert epoch_order(train, 0) == order
