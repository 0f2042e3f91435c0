"""`tools.export`: weights that load for inference without this project, as .pt, safetensors or a
Hugging Face folder; each of its options is held here by a test that fails when it is ignored."""

import json
import os

import pytest
import torch
from conftest import SMOKE_CONFIG
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from {{ cookiecutter.package_name }} import config, train
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.base.rundir import RunDir
from {{ cookiecutter.package_name }}.loop import checkpoint, optim, sharded_checkpoint
from {{ cookiecutter.package_name }}.loop.checkpoint import TrainState
from {{ cookiecutter.package_name }}.model import build_model
from {{ cookiecutter.package_name }}.tools import export

INFO = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bits, not merely equal values (-0.0 == 0.0, NaN != NaN)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def trained_looking_state(cfg, model: nn.Module, step: int) -> TrainState:
    """A TrainState at `step`, after filling every parameter and buffer of `model` with arbitrary
    bits, as after training."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            else:
                tensor.fill_(step)  # BatchNorm's num_batches_tracked
    optimizer = optim.build_optimizer(model, cfg, 1e-3)
    scheduler = optim.build_scheduler(optimizer, cfg, 100, 0.05)
    return TrainState(optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False), step=step)


def saved_checkpoint(tmp_path, step: int = 42):
    """(config, model, the checkpoint file) of a model with arbitrary weights."""
    cfg = config.load(SMOKE_CONFIG)
    model = build_model(cfg)
    state = trained_looking_state(cfg, model, step)
    path = checkpoint.save(model, state, RunDir(tmp_path / "run"), config.to_dict(cfg), INFO, keep_last=1)
    return cfg, model, path


def test_safetensors_export_round_trips_bit_identically(tmp_path):
    cfg, model, path = saved_checkpoint(tmp_path)
    output = tmp_path / "model.safetensors"
    assert export.export_weights(path, output) == "safetensors"  # chosen by the suffix
    assert output.stat().st_mode & 0o777 == 0o666 & ~umask()  # shareable as any new file (safetensors writes 0600)
    fresh = build_model(cfg)
    fresh.load_state_dict(load_file(output))  # strict: the same names, nothing extra or missing
    for name, tensor in model.state_dict().items():
        loaded = fresh.state_dict()[name]
        assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape, name
        assert torch.equal(bits(loaded), bits(tensor)), name
    with safe_open(output, framework="pt") as f:
        assert f.metadata() == {
            "format": "pt",
            "step": "42",
            "config_sha256": export.config_digest(config.to_dict(cfg)),
            "torch_version": torch.__version__,
        }


def test_config_digest_changes_with_any_setting_but_not_with_key_order():
    settings = config.to_dict(config.load(SMOKE_CONFIG))
    reordered = dict(reversed(list(settings.items())))
    changed = config.to_dict(config.load(SMOKE_CONFIG, ["optim.lr=0.5"]))
    assert export.config_digest(reordered) == export.config_digest(settings)
    assert export.config_digest(changed) != export.config_digest(settings)


def test_cli_picks_the_format_by_suffix_and_the_flag_overrides_it(tmp_path, capsys):
    _, model, path = saved_checkpoint(tmp_path)
    expected = model.state_dict()
    export.main([str(path), str(tmp_path / "weights.pt")])
    assert "torch.load(path, weights_only=True)" in capsys.readouterr().out
    plain = torch.load(tmp_path / "weights.pt", weights_only=True)
    export.main([str(tmp_path / "run"), str(tmp_path / "weights.bin"), "--format", "safetensors"])  # a run's newest
    assert "safetensors.torch.load_file(path)" in capsys.readouterr().out
    for weights in (plain, load_file(tmp_path / "weights.bin")):
        assert weights.keys() == expected.keys()
        assert all(torch.equal(weights[k], v) for k, v in expected.items())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_dtype_casts_every_floating_point_weight_and_keeps_integer_buffers(tmp_path, suffix):
    _, model, path = saved_checkpoint(tmp_path)
    expected = model.state_dict()
    for dtype, cast in export.DTYPES.items():
        output = tmp_path / f"{dtype}{suffix}"
        assert export.main([str(path), str(output), "--dtype", dtype]) == 0  # the command, in this process
        weights = load_file(output) if suffix == ".safetensors" else torch.load(output, weights_only=True)
        assert weights.keys() == expected.keys()
        for name, tensor in expected.items():
            assert weights[name].dtype == (cast if tensor.is_floating_point() else tensor.dtype), (dtype, name)
            assert torch.equal(weights[name], tensor.to(weights[name].dtype)), (dtype, name)


def test_missing_safetensors_is_one_line_that_says_what_to_install(tmp_path, monkeypatch, capsys):
    _, _, path = saved_checkpoint(tmp_path)
    monkeypatch.setattr(export.extras, "installed", lambda package: package != "safetensors")
    with pytest.raises(SystemExit) as exited:
        export.main([str(path), str(tmp_path / "model.safetensors")])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "config error: export to .safetensors needs safetensors, which is not installed: pip install -e '.[export]'\n"
    )
    assert not (tmp_path / "model.safetensors").exists()


def test_tied_weights_export_to_safetensors(tmp_path):
    """safetensors refuses two names on one storage; the export copies the second."""

    def tied() -> nn.Module:
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight  # an input embedding shared with the output layer
        return model

    model = tied()
    checkpoint.atomic_save({"model": model.state_dict(), "step": 3, "config": {}}, tmp_path / "tied.pt")
    export.export_weights(tmp_path / "tied.pt", tmp_path / "tied.safetensors")
    fresh = tied()
    fresh.load_state_dict(load_file(tmp_path / "tied.safetensors"))
    assert torch.equal(fresh[0].weight, model[0].weight) and fresh[1].weight is fresh[0].weight


def test_a_compiled_ddp_models_checkpoint_exports_without_wrapper_prefixes(tmp_path, world_of_one):
    # a real compiled 2-rank run's checkpoint is resumed by the compile=True project's Kubernetes
    # drill, which a leaked prefix would stop with the model-mismatch error
    cfg = config.load(SMOKE_CONFIG, ["train.compile=true"])
    raw = build_model(cfg)
    compiled = train.wrap(raw, cfg, INFO)  # compile only: a world of one gets no DDP from wrap
    wrapped = DDP(compiled)  # the nesting wrap builds on more ranks: DDP(compiled(raw))
    assert all(k.startswith("module._orig_mod.") for k in wrapped.state_dict())  # what must not leak
    state = trained_looking_state(cfg, raw, 7)
    path = checkpoint.save(wrapped, state, RunDir(tmp_path / "run"), config.to_dict(cfg), INFO, 1)
    export.export_weights(path, tmp_path / "model.safetensors")
    weights = load_file(tmp_path / "model.safetensors")
    assert not any(k.startswith(WRAPPER_PREFIXES) for k in weights)
    build_model(cfg).load_state_dict(weights)
    trained = wrapped.state_dict()
    assert all(torch.equal(v, trained[f"module._orig_mod.{k}"]) for k, v in weights.items())


def test_a_runs_launch_directory_is_found_from_where_its_checkpoint_lies(tmp_path):
    cfg = config.load(SMOKE_CONFIG, ["run.out_dir=runs", "run.name=mine"])
    saved = tmp_path / "project" / "runs" / "mine" / "checkpoints" / "step_00000010.pt"
    assert export.run_launch_directory(saved, cfg.run) == tmp_path / "project"
    sharded = saved.parent / "superseded" / "step_00000005"  # a sharded checkpoint's folder, set aside
    assert export.run_launch_directory(sharded, cfg.run) == tmp_path / "project"
    copied = tmp_path / "copied" / "checkpoints" / "step_1.pt"  # not its run's
    assert export.run_launch_directory(copied, cfg.run) is None
    assert export.run_launch_directory(saved, config.load(SMOKE_CONFIG, [f"run.out_dir={tmp_path}"]).run) is None
    elsewhere = tmp_path / "launched here"
    elsewhere.mkdir()
    assert export.run_launch_directory(saved, cfg.run, recorded=str(elsewhere)) == elsewhere  # what it records wins
    assert export.run_launch_directory(saved, cfg.run, recorded=str(tmp_path / "gone")) == tmp_path / "project"


def test_a_checkpoint_records_the_directory_its_run_was_launched_from(tmp_path, monkeypatch):
    launched = tmp_path / "launched"
    launched.mkdir()
    monkeypatch.chdir(launched)
    cfg = config.load(SMOKE_CONFIG)
    model = build_model(cfg)
    state = trained_looking_state(cfg, model, 3)
    for settings in (config.to_dict(cfg), config.to_dict(config.load(SMOKE_CONFIG, ["checkpoint.format=sharded"]))):
        if settings["checkpoint"]["format"] == "sharded" and sharded_checkpoint.floor_problem():
            continue
        path = checkpoint.save(model, state, RunDir(tmp_path / settings["checkpoint"]["format"]), settings, INFO, 1)
        assert checkpoint.load_file(path)["launch_dir"] == str(launched)


def test_a_model_that_is_not_a_transformers_model_exports_to_huggingface_with_one_line_saying_so(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(export.extras, "require", lambda package, needed_for: None)  # installed or not
    monkeypatch.setattr(export.task, "build_model", lambda cfg: nn.Linear(2, 2))  # a plain torch model
    saved = {"model": nn.Linear(2, 2).state_dict(), "step": 3, "config": config.to_dict(config.load(SMOKE_CONFIG))}
    checkpoint.atomic_save(saved, tmp_path / "plain.pt")
    with pytest.raises(SystemExit) as exited:
        export.main([str(tmp_path / "plain.pt"), str(tmp_path / "exported"), "--format", "huggingface"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "config error: export --format huggingface: the model is a Linear, not a transformers model "
        "(no save_pretrained); export .safetensors or .pt instead\n"
    )


def tiny_transformers_model(eos_token_id: int):
    """A one-layer Llama over the vocabulary of word_tokenizer, its eos as given."""
    transformers = pytest.importorskip("transformers", reason="the huggingface extra: pip install -e '.[huggingface]'")
    settings = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    settings |= {"num_key_value_heads": 1, "max_position_embeddings": 16, "tie_word_embeddings": True}
    ids = {"bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": 0}
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=6, **settings, **ids))


def word_tokenizer(path) -> None:
    """A tokenizer.json of six words, two of them special: <pad> (0) and <|endoftext|> (1)."""
    tokenizers = pytest.importorskip("tokenizers", reason="the huggingface extra: pip install -e '.[huggingface]'")
    words = {"<pad>": 0, "<|endoftext|>": 1, "[UNK]": 2, "def": 3, "return": 4, "x": 5}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<pad>", "<|endoftext|>"])
    tokenizer.save(str(path))


def hugging_face_checkpoint(tmp_path, monkeypatch, eos_token_id: int):
    """A checkpoint of tiny_transformers_model, which the seam builds, its data cut with word_tokenizer."""
    model = tiny_transformers_model(eos_token_id)
    word_tokenizer(tmp_path / "tokenizer.json")
    monkeypatch.setattr(export.task, "build_model", lambda cfg: tiny_transformers_model(eos_token_id))
    monkeypatch.setattr(export.task, "tokenizer_file", lambda cfg: tmp_path / "tokenizer.json", raising=False)
    saved = {"model": model.state_dict(), "step": 3, "config": config.to_dict(config.load(SMOKE_CONFIG))}
    checkpoint.atomic_save(saved, tmp_path / "hf.pt")
    return model, tmp_path / "hf.pt"


def test_huggingface_export_honours_dtype_and_names_the_tokenizers_special_tokens_as_the_model_does(
    tmp_path, monkeypatch
):
    model, path = hugging_face_checkpoint(tmp_path, monkeypatch, eos_token_id=1)
    transformers = pytest.importorskip("transformers")
    for dtype, cast in export.DTYPES.items():
        exported = tmp_path / dtype
        assert export.main([str(path), str(exported), "--format", "huggingface", "--dtype", dtype]) == 0
        weights = load_file(exported / "model.safetensors")
        assert (exported / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask()
        assert "lm_head.weight" not in weights  # the tied matrix, stored once
        assert {tensor.dtype for tensor in weights.values()} == {cast}, dtype
        assert torch.equal(weights["model.embed_tokens.weight"], model.model.embed_tokens.weight.to(cast))
        assert json.loads((exported / "config.json").read_text())["dtype"] == str(cast).removeprefix("torch.")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "fp32")
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|endoftext|>", "<pad>", None)
    assert loaded.generation_config.eos_token_id == tokenizer.eos_token_id == 1  # generate() stops where it says
    assert loaded.generation_config.pad_token_id == tokenizer.pad_token_id == 0


def test_huggingface_export_refuses_a_special_token_id_that_names_an_ordinary_token(tmp_path, monkeypatch, capsys):
    _, path = hugging_face_checkpoint(tmp_path, monkeypatch, eos_token_id=4)  # a config file's eos: "return" here
    with pytest.raises(SystemExit) as exited:
        export.main([str(path), str(tmp_path / "exported"), "--format", "huggingface"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"config error: export --format huggingface: the model's eos_token_id 4 is 'return' in the data's tokenizer "
        f"{tmp_path / 'tokenizer.json'}, not one of its special tokens (<pad>, <|endoftext|>); build the model with "
        "the tokenizer's ids (examples/huggingface/model.py takes them from the prepared data's meta.json), or None\n"
    )
    assert not (tmp_path / "exported").exists()
