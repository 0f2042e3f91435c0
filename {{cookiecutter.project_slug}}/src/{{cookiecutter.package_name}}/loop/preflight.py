"""Check the task seam on real samples before training starts.

A seam mistake (a model whose output does not fit the loss, a dataset that yields another
structure than task.py unpacks, labels out of range) would otherwise surface as a deep
traceback on one rank, or as a CUDA device-side assert, after the first collectives. Here
every rank runs the same seam calls on the same first samples, on the CPU and without gradients,
before the model moves to its device, each in the mode training calls it in (loss_sum in train
mode, the evaluation functions in eval mode), and stops with one line naming the seam function,
what it got and what was expected. The check leaves no trace: the model's buffers (BatchNorm's
statistics) and the random generators are as they were. The task's functions get the model
wrapped as training wraps it, whose calls pass through and attribute reads do not (DDP's), so a
task that reads its module's attributes off the model instead of through batching.unwrap stops
here too. gather_from_ranks stands for one process here (no collective on the CPU beside an NCCL
group), and counts its calls: a loss that gathers must say so (task.LOSS_SPANS_RANKS).
"""

from __future__ import annotations

import io
import math
import multiprocessing
import pickle
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .. import task
from ..base.across_ranks import as_one_process, gathers_replaced
from ..base.batching import describe, drawn_from, first_samples, num_samples
from ..base.rules import ConfigError

SAMPLES = 2  # enough to expose a batch dimension; cheap for any model on the CPU


class TaskError(ConfigError):
    """A mistake in the task seam (task.py, model.py, data.py); the message says what to fix."""

    prefix = "task error"


class Wrapped(nn.Module):
    """The model as the task's functions get it in training, here on the CPU: a wrapper whose
    calls pass every argument through and which has none of the module's attributes, as DDP's;
    batching.unwrap reaches the module, as it does under DDP, FSDP and torch.compile."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._orig_mod = module  # the name torch.compile gives it, which batching.unwrap removes

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


def check_task(
    model: nn.Module,
    train: tuple[Dataset, DataLoader],
    evaluation: tuple[Dataset, DataLoader],
    reference: DataLoader | None = None,
) -> None:
    """`train` and `evaluation`: (dataset, loader) pairs; `reference`: the loader of the task's
    reference set (task.reference_set), or None."""
    _check_workers_can_take("train", *train)
    _check_workers_can_take("eval", *evaluation)
    _check_evaluation_functions()
    wrapped = Wrapped(model)
    with _untouched(model), torch.no_grad():
        _check_loss(wrapped.train(), _batch("train", *train))
        wrapped.eval()
        _check_eval(wrapped, _batch("eval", *evaluation))
        if reference is not None:
            _check_reference(wrapped, _batch("reference", reference.dataset, reference))


@contextmanager
def _untouched(model: nn.Module):
    """The model's mode, buffers and the random generators as they were before, afterwards."""
    was_training = model.training
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    try:
        with drawn_from(0):
            yield
    finally:
        model.train(was_training)
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def _check_evaluation_functions() -> None:
    pairs = {"eval_sums": "metrics", "eval_outputs": "dataset_metrics", "reference_set": "eval_outputs"}
    for given, needed in pairs.items():
        if hasattr(task, given) and not hasattr(task, needed):
            raise TaskError(f"task.{given} is defined but task.{needed} is not; define both, see task.py's docstring")
    if not hasattr(task, "eval_sums") and not hasattr(task, "eval_outputs"):
        raise TaskError(
            "task.py defines neither eval_sums (per-sample sums) nor eval_outputs (dataset-level metrics); "
            "define one of them to evaluate"
        )


def _check_workers_can_take(name: str, dataset: Dataset, loader: DataLoader) -> None:
    """Loader workers that do not start by fork get the dataset pickled: one that does not pickle
    is one line here, not a traceback from the first batch."""
    start = (loader.multiprocessing_context or multiprocessing).get_start_method()
    if not loader.num_workers or start == "fork":
        return
    try:
        _WithoutData(io.BytesIO()).dump(dataset)
    except Exception as err:
        raise TaskError(
            f"build_datasets(cfg): the {name} set does not pickle ({_error(err)}), and this run's loader workers "
            f"start by {start}, which pickles it to each of them; make it picklable (no lambda or open file in "
            "it), or pass data.worker_start=fork"
        ) from err


class _WithoutData(pickle.Pickler):
    """Pickles all but the data of tensors and arrays (those pickle, and may be large)."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, (torch.Tensor, np.ndarray)) else None


def _batch(name: str, dataset: Dataset, loader: DataLoader) -> tuple[object, int]:
    """The first samples of `dataset` as its loader collates them, and how many they are."""
    if len(dataset) == 0:
        raise TaskError(f"build_datasets(cfg): the {name} set is empty; expected at least one sample")
    try:
        batch = first_samples(dataset, loader, SAMPLES)
    except Exception as err:
        collate = "task.collate" if hasattr(task, "collate") else "torch's default_collate (no task.collate)"
        raise TaskError(
            f"build_datasets(cfg): the first samples of the {name} set do not load and collate into a batch "
            f"with {collate} ({_error(err)}); expected every sample to hold tensors of the same shapes, or a "
            "task.collate that makes a batch of them (a list of per-image targets, say)"
        ) from err
    return batch, min(SAMPLES, len(dataset))


def _check_loss(model: nn.Module, collated: tuple[object, int]) -> None:
    batch, samples = collated
    outputs, gathers = [], []
    hook = model.register_forward_hook(lambda module, inputs, output: outputs.append(output))
    try:
        with gathers_replaced(lambda tensor: gathers.append(tensor) or (tensor, 0)):  # one process's loss
            loss = task.loss_sum(model, batch)
    except Exception as err:
        raise TaskError(
            f"task.loss_sum(model, batch) raised {_error(err)}; batch {describe(batch)}"
            + (f", model output {describe(outputs[0])}" if outputs else "")
            + f"; expected {_UNWRAP if _reads_the_wrapper(err) else _FITS}"
        ) from err
    finally:
        hook.remove()
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise TaskError(
            f"task.loss_sum(model, batch) returned {describe(loss)}; expected a scalar float tensor, the SUM "
            f"of the loss over the batch's terms (batch {describe(batch)})"
        )
    _check_spans_ranks(bool(gathers))
    try:
        terms = float(task.count_terms(batch))
    except Exception as err:
        raise TaskError(f"task.count_terms(batch) raised {_error(err)}; batch {describe(batch)}") from err
    if not terms >= 0 or not math.isfinite(terms):
        raise TaskError(f"task.count_terms(batch) returned {terms}; expected a number of loss terms >= 0")
    if task.TERMS_PER_SAMPLE is not None:
        check_declared_terms(terms, samples)


def spans_ranks() -> bool:
    """Whether the task declares a loss whose terms see other ranks' samples (gather_from_ranks)."""
    return bool(getattr(task, "LOSS_SPANS_RANKS", False))


def _check_spans_ranks(gathered: bool) -> None:
    """The proofs compare a loss that gathers with one process on every rank's batches: it must say so."""
    if gathered and not spans_ranks():
        raise TaskError(
            "task.loss_sum calls gather_from_ranks, but task.LOSS_SPANS_RANKS is not True: set it, so that the "
            "proofs compare the loop with one process on every rank's batches"
        )
    if spans_ranks() and not gathered:
        raise TaskError(
            "task.LOSS_SPANS_RANKS is True, but task.loss_sum never called gather_from_ranks: set it to False, or "
            "gather the other ranks' rows with base.across_ranks.gather_from_ranks"
        )


def check_declared_terms(terms: float, samples: int, batches: list | tuple = ()) -> None:
    """The loop trusts task.TERMS_PER_SAMPLE to count every rank's terms without a collective.
    `samples`: what full batches hold; `batches`: the batches themselves, counted where they hold
    fewer (a step called on a smaller micro-batch, as a proof of your own may)."""
    if terms == task.TERMS_PER_SAMPLE * samples:
        return
    held = sum(num_samples(batch) for batch in batches)
    if held and terms == task.TERMS_PER_SAMPLE * held:
        return
    raise TaskError(
        f"task.count_terms gave {terms:g} terms for {held or samples} samples, but task.TERMS_PER_SAMPLE is "
        f"{task.TERMS_PER_SAMPLE!r}: set it to the terms each sample holds, or to None when the count "
        "varies (padding, masks)"
    )


def _check_eval(model: nn.Module, collated: tuple[object, int]) -> None:
    batch, size = collated
    name, goal = task.MAIN_METRIC
    if goal not in ("max", "min"):
        raise TaskError(f"task.MAIN_METRIC is {task.MAIN_METRIC!r}; expected (name, 'max' or 'min')")
    if hasattr(task, "eval_outputs"):
        check_outputs(_called("eval_outputs", model, batch), size)
    if not hasattr(task, "eval_sums"):
        return  # the dataset's metrics: checked at the first evaluation, with every sample's outputs
    sums = _called("eval_sums", model, batch)
    if not isinstance(sums, dict) or not all(
        isinstance(v, torch.Tensor) and tuple(v.shape) == (size,) for v in sums.values()
    ):
        raise TaskError(
            f"task.eval_sums(model, batch) returned {describe(sums)}; expected a dict of tensors of shape "
            f"({size},), one value per sample of the batch"
        )
    totals = {name: float(values.double().sum()) for name, values in sums.items()} | {"samples": float(size)}
    try:
        results = task.metrics(totals)
        bad = not isinstance(results, dict) or not all(isinstance(float(v), float) for v in results.values())
    except Exception as err:
        raise TaskError(f"task.metrics(totals) raised {_error(err)}; totals had keys {sorted(totals)}") from err
    if bad:
        raise TaskError(f"task.metrics(totals) returned {describe(results)}; expected a dict of numbers")
    if name not in results and not hasattr(task, "dataset_metrics"):
        raise TaskError(
            f"task.MAIN_METRIC is {task.MAIN_METRIC!r}; expected (name, 'max' or 'min') with a name "
            f"that task.metrics returns ({', '.join(results)})"
        )


def _check_reference(model: nn.Module, collated: tuple[object, int]) -> None:
    batch, size = collated
    check_outputs(_called("eval_outputs", model, batch, "a batch of task.reference_set"), size)


def _called(function: str, model: nn.Module, batch, what: str = "batch"):
    """task.<function>(model, batch), a mistake in it one line."""
    try:
        with as_one_process():
            return getattr(task, function)(model, batch)
    except Exception as err:
        fix = f"; expected {_UNWRAP}" if _reads_the_wrapper(err) else ""
        raise TaskError(f"task.{function}(model, {what}) raised {_error(err)}; batch {describe(batch)}{fix}") from err


def check_outputs(outputs, samples: int):
    """`outputs` as eval_outputs must give them: a list of one item per sample, or a dict of tensors
    with the samples along dimension 0; returned as they are."""
    if isinstance(outputs, dict):
        lengths = {len(v) if isinstance(v, torch.Tensor) and v.dim() else None for v in outputs.values()}
    else:
        lengths = {len(outputs) if isinstance(outputs, (list, tuple)) else None}
    if lengths != {samples}:
        raise TaskError(
            f"task.eval_outputs(model, batch) returned {describe(outputs)} for a batch of {samples} samples; "
            "expected a list of one item per sample, or a dict of tensors with the samples along dimension 0"
        )
    return outputs


_FITS = "the model's output to fit the loss and the labels to be in range"
_UNWRAP = (
    "the task to call the model it is given (in training DDP, FSDP or torch.compile wraps it) and to read "
    "your module's attributes through batching.unwrap(model), e.g. unwrap(model).init_hidden(batch_size)"
)


def _reads_the_wrapper(err: Exception) -> bool:
    return isinstance(err, AttributeError) and f"'{Wrapped.__name__}' object has no attribute" in str(err)


def _error(err: Exception) -> str:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__
