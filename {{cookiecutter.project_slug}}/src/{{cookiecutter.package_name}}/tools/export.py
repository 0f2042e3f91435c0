"""Export a checkpoint's model weights for inference, without this project's code to load them.

    python -m {{ cookiecutter.package_name }}.tools.export runs/default model.safetensors   # the newest checkpoint
    python -m {{ cookiecutter.package_name }}.tools.export runs/default/checkpoints/step_00000500.pt model.pt
    python -m {{ cookiecutter.package_name }}.tools.export runs/default model.safetensors --dtype bf16  # smaller

An output ending in .safetensors gets safetensors (the project's export extra); any other a
plain state_dict; --format overrides the choice by suffix. The safetensors metadata records the
step, a digest of the training config and the torch version, and the file holds no pickled
objects.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

from .. import checkpoint, extras
from ..rules import exit_on_user_error

# how to load each export format for inference; neither needs this project's code
LOADERS = {
    "pt": "model.load_state_dict(torch.load(path, weights_only=True))",
    "safetensors": "model.load_state_dict(safetensors.torch.load_file(path))",
}


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_weights(target: str | Path, output: str | Path, fmt: str | None = None, dtype: str | None = None) -> str:
    """Write only the model's weights of the checkpoint `target` names (a file, a sharded
    checkpoint's directory, or a run directory's newest), their floating-point tensors cast to
    `dtype` if given (integer buffers stay); returns the format written."""
    fmt = fmt or ("safetensors" if Path(output).suffix == ".safetensors" else "pt")
    if fmt == "safetensors":
        extras.require("safetensors", "export to .safetensors")  # before the checkpoint is read
    _, payload = checkpoint.find(target)
    if dtype is not None:
        cast = DTYPES[dtype]
        payload["model"] = {k: v.to(cast) if v.is_floating_point() else v for k, v in payload["model"].items()}
    if fmt == "safetensors":
        save_safetensors(payload, output)
    else:
        torch.save(payload["model"], output)
    return fmt


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
    parser.add_argument("output", help="a .safetensors name selects safetensors; any other a plain state_dict")
    parser.add_argument("--format", choices=sorted(LOADERS), help="overrides the choice by suffix")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the floating-point weights (default: as saved)")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        fmt = export_weights(args.checkpoint, args.output, args.format, args.dtype)
    print(f"wrote {args.output}: load it with {LOADERS[fmt]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
