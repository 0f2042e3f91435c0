"""Export a checkpoint's model weights for inference, without this project's code to load them.

    python -m {{ cookiecutter.package_name }}.tools.export runs/default model.safetensors   # the newest checkpoint
    python -m {{ cookiecutter.package_name }}.tools.export runs/default/checkpoints/step_00000500.pt model.pt
    python -m {{ cookiecutter.package_name }}.tools.export runs/default model.safetensors --dtype bf16  # smaller
    python -m {{ cookiecutter.package_name }}.tools.export runs/default hf/ --format huggingface
    python -m {{ cookiecutter.package_name }}.tools.export runs/default ema.safetensors --weights ema  # EMA

An output ending in .safetensors gets safetensors (the project's export extra); any other a
plain state_dict; --format overrides the choice by suffix. The safetensors metadata records the
step, a digest of the training config and the torch version, and the file holds no pickled
objects. `--format huggingface` is for a model that is a `transformers` model (the huggingface
extra): it writes a folder `AutoModelForCausalLM.from_pretrained` (or the model's own Auto class)
loads: config.json, generation_config.json, model.safetensors with a tied weight stored once, and
the tokenizer the data was cut with when the task names its file (`task.tokenizer_file(cfg)`,
optional), its bos, eos and pad tokens named by the model's ids, so that `generate()` stops at the
tokenizer's end of text; an id that is not one of the tokenizer's special tokens stops the export.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import task
from ..base import extras, hardware
from ..base.rules import ConfigError, exit_on_user_error
from ..config import RunConfig, from_dict
from ..loop import checkpoint

# how to load each export format for inference; neither needs this project's code
LOADERS = {
    "pt": "model.load_state_dict(torch.load(path, weights_only=True))",
    "safetensors": "model.load_state_dict(safetensors.torch.load_file(path))",
    "huggingface": "transformers.AutoModelForCausalLM.from_pretrained(path)",
}


DTYPES = hardware.AUTOCAST_DTYPES  # --dtype: the precisions a run trains in


def export_weights(
    target: str | Path, output: str | Path, fmt: str | None = None, dtype: str | None = None, weights: str = "model"
) -> str:
    """Write only the model's weights of the checkpoint `target` names (a file, a sharded
    checkpoint's directory, or a run directory's newest), their floating-point tensors cast to
    `dtype` if given (integer buffers stay); `weights` ema: the EMA callback's average instead of
    the trained parameters. Returns the format written."""
    fmt = fmt or ("safetensors" if Path(output).suffix == ".safetensors" else "pt")
    if fmt == "huggingface":
        export_huggingface(target, output, dtype)
        return fmt
    if fmt == "safetensors":
        extras.require("safetensors", "export to .safetensors")  # before the checkpoint is read
    path, payload = checkpoint.find(target)
    if weights == "ema":
        payload["model"] = checkpoint.ema_weights(path, payload)
    if dtype is not None:
        cast = DTYPES[dtype]
        payload["model"] = {k: v.to(cast) if v.is_floating_point() else v for k, v in payload["model"].items()}
    if fmt == "safetensors":
        save_safetensors(payload, output)
    else:
        torch.save(payload["model"], output)
    return fmt


def export_huggingface(target: str | Path, output: str | Path, dtype: str | None = None) -> None:
    """The checkpoint's model as a folder that transformers' from_pretrained loads: the model the
    seam builds from the checkpoint's config must be a transformers model; the tokenizer file the
    task names (if any) goes along, with the settings transformers' tokenizer classes read."""
    extras.require("transformers", "export --format huggingface")  # before the checkpoint is read
    path, payload = checkpoint.find(target)
    cfg = from_dict(payload["config"])
    with launched_from(path, cfg.run, payload):  # the config's relative paths (dataset.dir) as the run saw them
        model = task.build_model(cfg)
        tokenizer = task.tokenizer_file(cfg) if hasattr(task, "tokenizer_file") else None
    if not callable(getattr(model, "save_pretrained", None)):
        raise ConfigError(
            f"export --format huggingface: the model is a {type(model).__name__}, not a transformers model "
            "(no save_pretrained); export .safetensors or .pt instead"
        )
    special = special_token_names(model, tokenizer) if tokenizer is not None else {}  # before anything is written
    model.load_state_dict(payload["model"])  # into the built parameters: a tied weight stays one
    if dtype is not None:
        model.to(DTYPES[dtype])
    model.save_pretrained(output)  # config.json, generation_config.json, model.safetensors: a tied weight once
    for weights in Path(output).glob("*.safetensors"):
        readable_as_new(weights)
    if tokenizer is not None:
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_file=str(tokenizer), **special).save_pretrained(output)


def special_token_names(model: torch.nn.Module, tokenizer: Path) -> dict[str, str]:
    """The tokenizer settings (bos_token, eos_token, pad_token) that name the tokens of the model's
    special-token ids (those generate() reads) in the data's `tokenizer`; each must be one of its
    special tokens: the ids of a config file written for another vocabulary name ordinary tokens
    here, and generate() would stop at one (a Llama's eos_token_id 2 is `"` in a byte-level BPE)."""
    from tokenizers import Tokenizer

    cut = Tokenizer.from_file(str(tokenizer))
    special = {i: token.content for i, token in cut.get_added_tokens_decoder().items() if token.special}
    settings = getattr(model, "generation_config", None) or model.config
    names = {}
    for role in ("bos", "eos", "pad"):
        ids = getattr(settings, f"{role}_token_id", None)
        for token_id in [] if ids is None else [ids] if isinstance(ids, int) else list(ids):
            if token_id not in special:
                raise ConfigError(
                    f"export --format huggingface: the model's {role}_token_id {token_id} is "
                    f"{cut.id_to_token(token_id)!r} in the data's tokenizer {tokenizer}, not one of its special tokens "
                    f"({', '.join(special.values()) or 'it has none'}); build the model with the tokenizer's ids "
                    "(examples/huggingface/model.py takes them from the prepared data's meta.json), or None"
                )
            names.setdefault(f"{role}_token", special[token_id])
    return names


def run_launch_directory(checkpoint_path: Path, run: RunConfig, recorded: str | None = None) -> Path | None:
    """The directory a run was launched from: the one its checkpoint records (`recorded`), where it
    still exists; else, for a checkpoint written before they recorded it, found from where it lies:
    the run directory (runs/<name>) is run.out_dir/run.name relative to it. None when neither tells."""
    if recorded is not None and Path(recorded).is_dir():
        return Path(recorded)
    relative = Path(run.out_dir) / run.name
    folder = next((p for p in Path(checkpoint_path).resolve().parents if p.name == "checkpoints"), None)
    if relative.is_absolute() or folder is None:
        return None
    root = folder.parent
    depth = len(relative.parts)
    if root.parts[-depth:] != relative.parts:
        return None
    return Path(*root.parts[:-depth])


@contextmanager
def launched_from(checkpoint_path: Path, run: RunConfig, payload: dict):
    """Inside, the working directory is the one the checkpoint's run was launched from (when it can
    be told), so the relative paths in its config (dataset.dir, ...) name what they named then."""
    directory = run_launch_directory(checkpoint_path, run, payload.get("launch_dir"))
    before = Path.cwd()
    if directory is None or not directory.is_dir():
        yield
        return
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def config_digest(config: dict) -> str:
    """sha256 of the config as sorted JSON: equal digests mean equal training settings."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def save_safetensors(payload: dict, output: str | Path) -> None:
    from safetensors.torch import save_file

    metadata = {
        "format": "pt",  # what Hugging Face loaders check before reading a torch safetensors file
        "step": str(payload["step"]),
        "config_sha256": config_digest(payload["config"]),
        "torch_version": torch.__version__,  # of the export; the checkpoint does not record training's
    }
    save_file(unshared(payload["model"]), str(output), metadata=metadata)
    readable_as_new(output)


def readable_as_new(path: str | Path) -> None:
    """The mode any new file gets here (0o666 less the umask): safetensors writes its files owner-only,
    and an export is made to be shared."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def unshared(weights: dict) -> dict:
    """Contiguous tensors with a storage each: safetensors refuses tied weights (two names, one
    storage), so later names get a copy; load_state_dict fills the tied parameter from either."""
    seen, result = set(), {}
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        result[name] = tensor.clone(memory_format=torch.contiguous_format) if storage in seen else tensor.contiguous()
        seen.add(storage)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "checkpoint", help="a checkpoint file or sharded checkpoint directory, or a run directory for its newest"
    )
    parser.add_argument(
        "output", help="a .safetensors name selects safetensors; any other a plain state_dict (huggingface: a folder)"
    )
    parser.add_argument("--format", choices=sorted(LOADERS), help="overrides the choice by suffix")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the floating-point weights (default: as saved)")
    parser.add_argument(
        "--weights", choices=["model", "ema"], default="model", help="ema: the EMA callback's average (run.callbacks)"
    )
    args = parser.parse_args(argv)
    with exit_on_user_error():
        if args.weights == "ema" and args.format == "huggingface":
            raise ConfigError("--weights ema: export to .safetensors or .pt; --format huggingface takes the model's")
        fmt = export_weights(args.checkpoint, args.output, args.format, args.dtype, args.weights)
    print(f"wrote {args.output}: load it with {LOADERS[fmt]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
