"""Check the task seam on real samples before training starts.

A seam mistake (a model whose output does not fit the loss, a dataset that yields another
structure than task.py unpacks, labels out of range) would otherwise surface as a deep
traceback on one rank, or as a CUDA device-side assert, after the first collectives. Here
every rank runs the same seam calls on the same first samples, on the CPU, in eval mode and
without gradients, before the model moves to its device, and stops with one line naming the
seam function, what it got and what was expected. The task's functions get the model wrapped as
training wraps it, whose calls pass through and attribute reads do not (DDP's), so a task that
reads its module's attributes off the model instead of through samples.unwrap stops here too.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import pickle

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .. import task
from ..base.batching import describe, first_samples, num_samples
from ..base.rules import ConfigError

SAMPLES = 2  # enough to expose a batch dimension; cheap for any model on the CPU


class TaskError(ConfigError):
    """A mistake in the task seam (task.py, model.py, data.py); the message says what to fix."""

    prefix = "task error"


class Wrapped(nn.Module):
    """The model as the task's functions get it in training, here on the CPU: a wrapper whose
    calls pass every argument through and which has none of the module's attributes, as DDP's;
    samples.unwrap reaches the module, as it does under DDP, FSDP and torch.compile."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._orig_mod = module  # the name torch.compile gives it, which samples.unwrap removes

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


def check_task(model: nn.Module, train: tuple[Dataset, DataLoader], evaluation: tuple[Dataset, DataLoader]) -> None:
    _check_workers_can_take("train", *train)
    _check_workers_can_take("eval", *evaluation)
    was_training = model.training
    wrapped = Wrapped(model).eval()
    try:
        with torch.no_grad():
            train_batch = _batch("train", *train)
            _check_loss(wrapped, train_batch)
            _check_eval(wrapped, _batch("eval", *evaluation))
    finally:
        model.train(was_training)


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


def _batch(name: str, dataset: Dataset, loader: DataLoader):
    if len(dataset) == 0:
        raise TaskError(f"build_datasets(cfg): the {name} set is empty; expected at least one sample")
    try:
        batch = first_samples(dataset, loader, SAMPLES)
    except Exception as err:
        raise TaskError(
            f"build_datasets(cfg): the first samples of the {name} set do not load and collate into a batch "
            f"({_error(err)}); expected every sample to hold tensors of the same shapes"
        ) from err
    if num_samples(batch) == 0:
        raise TaskError(
            f"build_datasets(cfg): a {name} batch is {describe(batch)}; expected tensors with a batch dimension"
        )
    return batch


def _check_loss(model: nn.Module, batch) -> None:
    outputs = []
    hook = model.register_forward_hook(lambda module, inputs, output: outputs.append(output))
    try:
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
    try:
        terms = float(task.count_terms(batch))
    except Exception as err:
        raise TaskError(f"task.count_terms(batch) raised {_error(err)}; batch {describe(batch)}") from err
    if not terms >= 0 or not math.isfinite(terms):
        raise TaskError(f"task.count_terms(batch) returned {terms}; expected a number of loss terms >= 0")
    if task.TERMS_PER_SAMPLE is not None:
        check_declared_terms(terms, num_samples(batch))


def check_declared_terms(terms: float, samples: int) -> None:
    """The loop trusts task.TERMS_PER_SAMPLE to count every rank's terms without a collective."""
    if terms != task.TERMS_PER_SAMPLE * samples:
        raise TaskError(
            f"task.count_terms gave {terms:g} terms for {samples} samples, but task.TERMS_PER_SAMPLE is "
            f"{task.TERMS_PER_SAMPLE!r}: set it to the terms each sample holds, or to None when the count "
            "varies (padding, masks)"
        )


def _check_eval(model: nn.Module, batch) -> None:
    size = num_samples(batch)
    try:
        sums = task.eval_sums(model, batch)
    except Exception as err:
        fix = f"; expected {_UNWRAP}" if _reads_the_wrapper(err) else ""
        raise TaskError(f"task.eval_sums(model, batch) raised {_error(err)}; batch {describe(batch)}{fix}") from err
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
    name, goal = task.MAIN_METRIC
    if name not in results or goal not in ("max", "min"):
        raise TaskError(
            f"task.MAIN_METRIC is {task.MAIN_METRIC!r}; expected (name, 'max' or 'min') with a name "
            f"that task.metrics returns ({', '.join(results)})"
        )


_FITS = "the model's output to fit the loss and the labels to be in range"
_UNWRAP = (
    "the task to call the model it is given (in training DDP, FSDP or torch.compile wraps it) and to read "
    "your module's attributes through samples.unwrap(model), e.g. unwrap(model).init_hidden(batch_size)"
)


def _reads_the_wrapper(err: Exception) -> bool:
    return isinstance(err, AttributeError) and f"'{Wrapped.__name__}' object has no attribute" in str(err)


def _error(err: Exception) -> str:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__
