"""The image classifier's task: the sample tree, the ImageFolder checks, seeded augmentation,
the torchvision model, top-1/top-5, FLOPs; and a real training run."""

import io
import pickle
import sys
import time

import pytest
import torch
from conftest import PACKAGE, SMOKE_CONFIG, read_metrics, run, torchrun, train_args
from PIL import Image
from test_faults import assert_bit_identical, final_state

from {{ cookiecutter.package_name }} import config, data, model, shapes, task, train
from {{ cookiecutter.package_name }}.base import batching
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import loaders, preflight

CPU = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
LAST_EPOCH = 160  # the step the sample's 5th epoch starts at: 40 steps of 2 x 16 images an epoch


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A small tree of the sample's shapes: 5 classes, 6 training and 3 eval images each."""
    return shapes.write_tree(tmp_path_factory.mktemp("images") / "shapes", 6, 3, 40)


def small_config(tree, *overrides):
    return config.load(SMOKE_CONFIG, [f"dataset.root={tree}", *overrides])


def test_the_sample_tree_holds_real_images_drawn_the_same_every_time(tree, tmp_path):
    again = shapes.write_tree(tmp_path / "again", 6, 3, 40)
    files = sorted(p.relative_to(tree) for p in tree.rglob("*.jpg"))
    assert len(files) == 5 * (6 + 3) and sorted(p.relative_to(again) for p in again.rglob("*.jpg")) == files
    assert all((tree / f).read_bytes() == (again / f).read_bytes() for f in files)
    with Image.open(tree / "train" / "star" / "00000.jpg") as image:
        assert (image.format, image.size, image.mode) == ("JPEG", (40, 40), "RGB")
    assert data.tree_problems(tree) == []


def test_the_seam_sums_the_loss_and_counts_top1_and_top5_per_image(tree):
    cfg = small_config(tree)
    net = task.build_model(cfg)
    train_set, eval_set = task.build_datasets(cfg)
    train_loader, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, CPU, 0)
    preflight.check_task(net, (train_set, train_loader), (eval_set, eval_loader))
    images, labels = batch = batching.first_samples(eval_set, eval_loader, 4)
    assert images.shape == (4, 3, 32, 32) and labels.tolist() == [0, 0, 0, 1]  # classes: sorted folder names
    assert train_set.dataset.classes == eval_set.classes == list(shapes.SHAPES)  # an ImageFolder in SeededSamples
    net.eval()
    mean = torch.nn.functional.cross_entropy(net(images), labels)
    assert torch.allclose(task.loss_sum(net, batch), 4 * mean) and task.count_terms(batch) == 4
    sums = task.eval_sums(net, batch)
    ranked = net(images).argsort(dim=1, descending=True)
    assert sums["top1"].tolist() == (ranked[:, 0] == labels).float().tolist()
    assert sums["top5"].tolist() == [1.0] * 4  # 5 classes: the true one is always among the top 5
    results = task.metrics({"loss": 2.0, "top1": 3.0, "top5": 4.0, "samples": 4.0})
    assert results == {"loss": 0.5, "top1": 0.75, "top5": 1.0} and task.MAIN_METRIC == ("top1", "max")


def test_top5_counts_a_label_ranked_sixth_as_a_miss():
    logits = torch.tensor([[6.0, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6]])
    sums = task.eval_sums(lambda images: logits, (None, torch.tensor([5, 2])))
    assert sums["top1"].tolist() == [0.0, 0.0] and sums["top5"].tolist() == [0.0, 1.0]


def test_augmentation_depends_on_the_seed_epoch_and_index_only(tree):
    train_set, _ = task.build_datasets(small_config(tree))
    state = torch.get_rng_state()
    first = train_set[7][0]
    assert torch.equal(first, train_set[7][0]) and not torch.equal(first, train_set[8][0])
    assert torch.equal(torch.get_rng_state(), state)  # the process's own stream is untouched
    worker_copy = pickle.loads(pickle.dumps(train_set))  # a copy in another process, made at epoch 0
    train_set.set_epoch(1)
    assert torch.equal(worker_copy[7][0], first)
    assert not torch.equal(train_set[7][0], first)  # a new epoch, new crops


def first_batch(tree, start: str, workers: int, dataset_epoch: int | None = None):
    """A loader of the training set as the loop builds it (persistent workers), and its first batch
    of epoch 1; the dataset's epoch set to `dataset_epoch` before the workers start, if given."""
    cfg = small_config(tree, f"data.worker_start={start}", "data.batch_size=4")
    train_set, eval_set = task.build_datasets(cfg)
    if dataset_epoch is not None:
        train_set.set_epoch(dataset_epoch)
    loader, _ = loaders.build_loaders(train_set, eval_set, cfg, CPU, workers)
    loader.sampler.set_epoch(1)
    return loader, next(iter(loader))


@pytest.mark.parametrize(
    "start",
    ["fork", pytest.param("forkserver", marks=pytest.mark.slow), pytest.param("spawn", marks=pytest.mark.slow)],
)
def test_each_epochs_crops_reach_persistent_loader_workers_whatever_starts_them(tree, start):
    persistent, _ = first_batch(tree, start, workers=1, dataset_epoch=0)  # its worker starts in epoch 0 ...
    persistent.dataset.set_epoch(1)  # ... and lives on into epoch 1 (train.fit calls set_epoch as here)
    images, labels = next(iter(persistent))
    _, (fresh, fresh_labels) = first_batch(tree, "fork", workers=1, dataset_epoch=1)  # a worker started in epoch 1
    _, (stale, _) = first_batch(tree, "fork", workers=0, dataset_epoch=0)  # epoch 1's images, epoch 0's crops
    assert torch.equal(labels, fresh_labels) and torch.equal(images, fresh)
    assert not torch.equal(images, stale)


def test_packed_records_turn_into_the_samples_of_the_tree(tree):
    cfg = small_config(tree)
    from_records = task.from_records(cfg, *task.build_records(cfg))
    for records, decoded in zip(from_records, task.build_datasets(cfg), strict=True):
        for i in (0, len(decoded) - 1):
            assert torch.equal(records[i][0], decoded[i][0]) and records[i][1] == decoded[i][1]
    assert task.pack_facts(cfg) == {"classes": list(shapes.SHAPES)}


def test_pack_max_side_re_encodes_only_images_with_a_longer_shorter_side(tree):
    path = next((tree / "train" / "star").iterdir())
    assert data.encoded(str(path), None) == data.encoded(str(path), 40) == path.read_bytes()  # 40 x 40 images
    smaller = Image.open(io.BytesIO(data.encoded(str(path), 20)))
    assert smaller.size == (20, 20) and smaller.format == "JPEG"


def test_hflip_false_leaves_the_training_images_unmirrored(tree):
    from torchvision.transforms import RandomHorizontalFlip

    for hflip in (True, False):
        train, evaluation = data.transforms(small_config(tree, f"dataset.hflip={str(hflip).lower()}"))
        assert any(isinstance(t, RandomHorizontalFlip) for t in train.transforms) is hflip
        assert not any(isinstance(t, RandomHorizontalFlip) for t in evaluation.transforms)


def test_every_problem_of_a_tree_gets_its_own_line_before_any_collective(tree, tmp_path):
    broken = tmp_path / "broken"
    for folder in ("train/cat", "train/dog", "train/empty", "val/cat", "val/cow"):
        (broken / folder).mkdir(parents=True)
    for image in ("train/cat/a.jpg", "train/dog/b.png", "val/cat/c.jpg", "val/cow/d.JPEG"):
        (broken / image).write_bytes(b"")
    lines = data.tree_problems(broken)
    assert len(lines) == 2 and all(line.startswith("dataset.root: ") for line in lines)
    assert f"{broken / 'train' / 'empty'} holds no images" in lines[0]
    assert "only in train: dog, empty; only in val: cow" in lines[1]
    world_of_two = DistInfo(0, 0, 2, 2, torch.device("cpu"), "gloo")  # no process group: a collective would raise
    with pytest.raises(config.ConfigError) as error:
        train.build(small_config(broken), world_of_two)
    assert str(error.value) == "\n".join(lines)
    (missing,) = data.tree_problems(tmp_path / "nowhere")
    assert "is not a folder" in missing and f"python -m {PACKAGE}.shapes DIR" in missing
    split_missing = "is missing; the tree needs train/ and val/, each with one folder per class"
    assert data.tree_problems(tree / "train") == [  # pointed one level too deep
        f"dataset.root: {tree / 'train' / split} {split_missing}" for split in ("train", "val")
    ]


def test_a_wrong_arch_or_weights_name_is_a_config_error_with_suggestions(tree):
    with pytest.raises(config.ConfigError, match="model.arch: 'resnet19' is not a torchvision classifier; try resnet"):
        task.build_model(small_config(tree, "model.arch=resnet19"))
    with pytest.raises(
        config.ConfigError, match="resnet18 has no weights 'IMAGENET'; use one of IMAGENET1K_V1, DEFAULT"
    ):
        task.build_model(small_config(tree, "model.arch=resnet18", "model.weights=IMAGENET"))


def test_pretrained_weights_out_of_reach_are_one_config_error_naming_the_cache(tree, tmp_path, monkeypatch):
    from urllib.error import URLError

    def offline(url, dst, *args, **kwargs):
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))  # an empty cache: the file must be fetched
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(config.ConfigError) as error:
        task.build_model(small_config(tree, "model.arch=resnet18", "model.weights=DEFAULT"))
    message = str(error.value)
    assert message.startswith("model.weights: DEFAULT for resnet18 could not be fetched from https://")
    assert "Name or service not known" in message and f"copy it into {tmp_path / 'hub'}/checkpoints" in message


def test_fine_tuning_replaces_the_last_linear_layer_only():
    from torchvision import models

    net = models.get_model("efficientnet_b0", num_classes=1000)
    before = net.classifier[1]
    model.replace_head(net, 5, "efficientnet_b0")
    head = net.classifier[1]
    assert head is not before and (head.in_features, head.out_features) == (1280, 5)
    with pytest.raises(config.ConfigError, match="squeezenet1_1 ends in no linear layer"):
        model.replace_head(models.get_model("squeezenet1_1"), 5, "squeezenet1_1")


def test_cuda_runs_are_channels_last_and_cpu_runs_keep_the_default_layout(tree, monkeypatch):
    assert model.image_layout(torch.device("cuda", 0)) is torch.channels_last
    images, labels = task.to_device((torch.rand(2, 3, 8, 8), torch.tensor([0, 1])), torch.device("cpu"))
    assert images.is_contiguous() and not images.is_contiguous(memory_format=torch.channels_last)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU node: the model is built NHWC
    conv = next(m for m in task.build_model(small_config(tree)).modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()


def test_training_flops_match_torchvisions_published_count(tree):
    from torchvision.models import ResNet18_Weights

    published = ResNet18_Weights.DEFAULT.meta["_ops"] * 1e9  # multiply-adds of a 224 x 224 forward
    counted = model.training_flops_per_image(small_config(tree, "model.arch=resnet18", "dataset.image_size=224"), 1000)
    assert counted == pytest.approx(3 * 2 * published, rel=0.01)  # 2 FLOPs a multiply-add; backward = 2 forwards
    assert task.throughput(small_config(tree), None).unit == "images"


@pytest.mark.task
def test_a_torchvision_model_learns_the_shapes_on_two_ranks(tmp_path):
    """The built-in sample (dataset.root: null): real JPEGs decoded by loader workers."""
    overrides = ["run.name=shapes", "train.epochs=5", "data.num_workers=1"]  # 200 steps of 2 x 16 images
    torchrun(*train_args(tmp_path, *overrides, f"checkpoint.every_steps={LAST_EPOCH}"), timeout=400)
    evals = [r for r in read_metrics(tmp_path / "shapes") if "eval_top1" in r]
    assert evals[-1]["eval_top1"] >= 0.9 and evals[-1]["eval_samples"] == 305, evals[-1]  # chance is 0.2
    record = next(r for r in read_metrics(tmp_path / "shapes") if "images_per_s" in r)
    assert record["images_per_s"] == pytest.approx(record["samples_per_s"]) and "mfu" not in record

    # packed (encoded JPEG bytes and labels), the last epoch again: the same crops, the same weights
    packed = tmp_path / "packed"
    run([sys.executable, "-m", f"{PACKAGE}.tools.pack", str(packed), "--config", SMOKE_CONFIG], timeout=120)
    in_order = ("run.name=shapes-shards", f"data.shards={packed}", "data.shards_order=shuffle")  # the tree's order
    last_epoch = f"checkpoint.resume={tmp_path / 'shapes' / 'checkpoints' / f'step_{LAST_EPOCH:08d}.pt'}"
    resumed = torchrun(*train_args(tmp_path, *overrides[1:], *in_order, last_epoch), timeout=200)
    assert f"at step {LAST_EPOCH}" in resumed.stdout
    tree_run, shards_run = (final_state(tmp_path / run, 200) for run in ("shapes", "shapes-shards"))
    assert_bit_identical(shards_run["model"], tree_run["model"], "model")
    tree_top1, shards_top1 = (  # from the resumed run's first evaluation, of the step-160 weights, on
        [r["eval_top1"] for r in read_metrics(tmp_path / run) if "eval_top1" in r and r["step"] >= LAST_EPOCH]
        for run in ("shapes", "shapes-shards")
    )
    assert shards_top1 == tree_top1 and len(tree_top1) == 2


@pytest.mark.task
def test_a_missing_root_ends_a_two_rank_run_with_one_line_per_rank_and_exit_2(tmp_path):
    missing = tmp_path / "nowhere"
    start = time.monotonic()
    result = torchrun(*train_args(tmp_path, f"dataset.root={missing}"), check=False, timeout=60)
    assert time.monotonic() - start < 30 and result.returncode != 0
    assert result.stderr.count(f"config error: dataset.root: {missing} is not a folder") == 2, result.stderr
    assert "exitcode  : 2" in result.stderr and "data.py" not in result.stderr  # a line, not a traceback
    alone = run([sys.executable, *train_args(tmp_path, f"dataset.root={missing}")], check=False, timeout=60)
    assert alone.returncode == 2 and alone.stderr.count("config error: dataset.root:") == 1
