"""The Hugging Face model's task: the seam, tied embeddings and units, other architectures and
config files; and the round trip: a tokenizer.json, a run under fsdp, an export that transformers
loads back and scores as the run did."""

import email
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PACKAGE, PROJECT, SMOKE_CONFIG, project_env, read_metrics

from {{ cookiecutter.package_name }} import config, data, task
from {{ cookiecutter.package_name }}.base import batching
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import loaders, parallel, preflight
from {{ cookiecutter.package_name }}.model import training_flops_per_token
from {{ cookiecutter.package_name }}.tools import diagnose, prepare

transformers = pytest.importorskip("transformers", reason="the huggingface extra: pip install -e '.[huggingface]'")

CPU = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")


def small_config(*overrides):
    return config.load(SMOKE_CONFIG, [*overrides])


def first_batch(cfg, size=3):
    train_set, _ = task.build_datasets(cfg)
    return torch.utils.data.default_collate([train_set[i] for i in range(size)])


def test_the_seam_calls_the_model_with_keyword_arguments_and_sums_the_loss_over_tokens():
    cfg = small_config()
    model = task.build_model(cfg)
    assert isinstance(model, transformers.LlamaForCausalLM)
    train_set, eval_set = task.build_datasets(cfg)
    train_loader, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, CPU, 0)
    preflight.check_task(model, (train_set, train_loader), (eval_set, eval_loader))
    batch = batching.first_samples(train_set, train_loader, 3)
    logits = model(input_ids=batch[0]).logits
    mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
    assert task.count_terms(batch) == 3 * cfg.model.context
    assert torch.allclose(task.loss_sum(model, batch), mean * 3 * cfg.model.context)
    assert math.isclose(mean.item(), math.log(256), rel_tol=0.05)  # from_config's init: a near-uniform first guess
    assert task.eval_sums(model, batch)["tokens"].tolist() == [cfg.model.context] * 3


def test_the_embeddings_are_tied_in_the_roots_group_and_the_decoder_layers_are_the_units():
    model = task.build_model(small_config())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    units = parallel.units(model)
    assert units == list(model.model.layers) and {type(u).__name__ for u in units} == set(model._no_split_modules)
    assert parallel.split_parameter(model, units) is None  # no unit holds the tied matrix
    untied = task.build_model(small_config("model.tie_embeddings=false"))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_every_parameter_gets_a_gradient_so_ddp_needs_no_unused_parameter_search():
    assert diagnose.unused_parameters(small_config(), task.build_model(small_config())) == []  # `diagnose unused`


def test_the_model_is_causal():
    model = task.build_model(small_config()).eval()
    tokens = torch.randint(0, 256, (1, 64))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    with torch.no_grad():  # the last token cannot change what comes before it
        assert torch.equal(model(input_ids=tokens).logits[0, :-1], model(input_ids=changed).logits[0, :-1])


def test_gpt2_builds_from_the_same_settings_and_a_config_file_from_its_own(tmp_path):
    gpt2 = task.build_model(small_config("model.model_type=gpt2"))
    assert isinstance(gpt2, transformers.GPT2LMHeadModel) and gpt2.config.n_embd == 64 and gpt2.config.n_layer == 2
    assert gpt2.config.resid_pdrop == 0.0 and gpt2.config.eos_token_id is None  # no id beyond the byte vocabulary
    assert {type(u).__name__ for u in parallel.units(gpt2)} == {"GPT2Block"}
    assert torch.isfinite(task.loss_sum(gpt2, first_batch(small_config())))

    llama_config(tmp_path / "llama", hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6)
    model = task.build_model(small_config(f"model.config={tmp_path / 'llama'}"))
    assert model.config.num_hidden_layers == 3 and model.config.hidden_size == 96
    assert model.config.vocab_size == 256  # the prepared data's: every id it holds has a row
    assert model.generation_config.eos_token_id is None  # bytes have no end of text; the file's 2 is a byte here
    with pytest.raises(config.ConfigError, match="model.context: 256 is longer than .* max_position_embeddings"):
        task.build_model(small_config(f"model.config={tmp_path / 'llama'}", "model.context=256"))
    with pytest.raises(config.ConfigError, match="model.model_type: transformers .* knows no 'lama'"):
        task.build_model(small_config("model.model_type=lama"))


def llama_config(folder: Path, **settings) -> Path:
    """A Llama's config.json with its own special-token ids (bos 1, eos 2), as a user copies one; the
    test-sized defaults' sizes, unless `settings` say otherwise."""
    defaults = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4}
    defaults |= {"num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True}
    defaults |= {"vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2}
    transformers.LlamaConfig(**defaults | settings).save_pretrained(folder)
    return folder


def test_the_settings_a_config_file_decides_are_named_in_one_note_line(tmp_path, capsys, monkeypatch):
    folder = llama_config(tmp_path / "llama", num_hidden_layers=3)
    task.build_model(small_config(f"model.config={folder}", "model.dropout=0.1", "model.tie_embeddings=false"))
    assert capsys.readouterr().out == (
        f"note: model.config {folder} decides the model: model.layers=2 (the file: num_hidden_layers=3), "
        "model.tie_embeddings=False (the file: tie_word_embeddings=True), "
        "model.dropout=0.1 (the file: attention_dropout=0.0) are not used\n"
    )
    task.build_model(small_config(f"model.config={folder}", "model.layers=3"))  # the file's sizes: nothing to say
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)  # every rank builds the model; rank 0 says it
    task.build_model(small_config(f"model.config={folder}", "model.dropout=0.1"))
    assert capsys.readouterr().out == ""


def test_the_special_token_ids_are_the_data_tokenizers_whatever_the_config_file_says(tmp_path):
    corpus = tmp_path / "train.txt"
    corpus.write_bytes(b"".join(path.read_bytes() for path in sorted(Path(email.__file__).parent.glob("*.py"))))
    byte_level_tokenizer(corpus, tmp_path / "bpe.json", vocabulary=300, special=["<pad>", "<|endoftext|>"])
    prepare.prepare([corpus], tmp_path / "tokens", tokenizer_name=str(tmp_path / "bpe.json"))
    data_settings = f"dataset.dir={tmp_path / 'tokens'}"
    for built in (
        task.build_model(small_config(data_settings, f"model.config={llama_config(tmp_path / 'llama')}")),
        task.build_model(small_config(data_settings, "model.model_type=gpt2")),  # GPT-2's own: 50256 for all three
    ):
        ids = built.generation_config  # what generate() reads
        assert (ids.bos_token_id, ids.eos_token_id, ids.pad_token_id) == (None, 1, 0), type(built).__name__


def test_training_flops_per_token_count_the_tied_matrix_once():
    cfg = small_config()
    tied, untied = task.build_model(cfg), task.build_model(small_config("model.tie_embeddings=false"))
    attention = 12 * 2 * 64 * 64  # 2 layers, context 64, width 64
    weights = sum(p.numel() for p in tied.parameters())  # the tied matrix once, as the output head
    assert training_flops_per_token(tied, 64) == 6 * weights + attention
    assert training_flops_per_token(untied, 64) == training_flops_per_token(tied, 64)  # the input table is looked up
    assert task.throughput(cfg, tied).flops_per_unit == 6 * weights + attention


def byte_level_tokenizer(corpus: Path, path: Path, vocabulary: int, special: list[str] = ()) -> None:
    """A BPE tokenizer.json learnt from `corpus` with the tokenizers library, as a user brings one,
    its `special` tokens first (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocabulary, initial_alphabet=alphabet, special_tokens=list(special))
    tokenizer.train([str(corpus)], trainer)
    tokenizer.save(str(path))


def window_loss(model, tokens: np.ndarray, context: int, windows: int) -> float:
    """Nats per token of `model` on the first `windows` windows of `tokens` (as data.TokenWindows
    cuts them), in plain torch: what anyone scores the exported model with."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, windows, 16):
            ids = torch.stack([
                torch.from_numpy(tokens[i * context : i * context + context + 1].astype(np.int64))
                for i in range(start, min(windows, start + 16))
            ])  # fmt: skip
            logits = model(input_ids=ids[:, :-1]).logits.double()
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="sum").item()
    return total / (windows * context)


@functools.cache
def startup_seconds() -> float:
    """Seconds a fresh interpreter takes here and now to import what this test's processes import
    (the project's training code, torch, a transformers model): the unit of the hang bounds below,
    so that they stretch with the machine's load. tests/test_huggingface.py passes its own
    measurement in STARTUP_SECONDS."""
    if os.environ.get("STARTUP_SECONDS"):
        return float(os.environ["STARTUP_SECONDS"])
    began = time.monotonic()
    imports = f"import {PACKAGE}.train, transformers.models.llama.modeling_llama"
    subprocess.run([sys.executable, "-c", imports], env=project_env(), check=True, capture_output=True)
    return time.monotonic() - began


def hang_bound(startups: float) -> float:
    """A limit that only a hang passes: `startups` start-ups' time (startup_seconds). Measured on a
    2-core box under a load of 8 (a start-up 11-14 s), prepare took 0.4 start-ups, the smoke run 2.7,
    export 1 and sample 1.4: each count below is 7 x or more."""
    return startups * startup_seconds()


@pytest.mark.task
def test_the_hugging_face_round_trip_trains_under_fsdp_exports_and_loads_back_with_the_same_eval_loss(tmp_path):
    """A tokenizer.json learnt from Python's email sources with an end-of-text token, separate
    training and evaluation files, a Llama config.json with its own special-token ids, the smoke
    check's 2-rank run under fsdp with activation checkpointing, launched with relative paths;
    then, from another directory, the export, which from_pretrained loads and scores as the run's
    own evaluation did, whose generate() stops only at the tokenizer's end of text, and a sample."""
    sources = sorted(Path(email.__file__).parent.glob("*.py"))
    corpus, held_out = tmp_path / "train.txt", tmp_path / "eval.txt"
    corpus.write_bytes(b"".join(path.read_bytes() for path in sources[:-3]))
    held_out.write_bytes(b"".join(path.read_bytes() for path in sources[-3:]))
    byte_level_tokenizer(corpus, tmp_path / "bpe.json", vocabulary=512, special=["<|endoftext|>"])
    env = project_env()
    prepared = [sys.executable, "-m", f"{PACKAGE}.tools.prepare", str(corpus), "--eval", str(held_out)]
    prepared += ["--tokenizer", str(tmp_path / "bpe.json"), "--out", str(tmp_path / "tokens")]
    subprocess.run(prepared, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=hang_bound(10), check=True)
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["vocabulary_size"] == 512
    assert meta["special_tokens"] == {"bos": None, "eos": 0, "pad": None}  # <|endoftext|>, the trainer's first
    assert (tmp_path / "tokens" / "tokenizer.json").read_bytes() == (tmp_path / "bpe.json").read_bytes()

    # the smoke check's run, launched from the data's folder with paths relative to it (as
    # `scripts/train.sh dataset.dir=data/mine` is from a project); fp32, so that transformers scores it the same
    # a Llama's config.json: its ids name ordinary tokens of this tokenizer (bos 1 is `!`; eos 2 is
    # `"`, here the newline's id, the commonest token, so that an eos kept would end every sample early)
    newline = json.loads((tmp_path / "bpe.json").read_text())["model"]["vocab"]["Ċ"]
    llama_config(tmp_path / "llama", eos_token_id=newline)
    run = [
        "parallel.strategy=fsdp",
        "parallel.activation_checkpointing=full",
        "train.precision=fp32",
        "train.max_steps=40",
        "model.config=llama",
    ]
    smoke = ["bash", str(PROJECT / "scripts" / "smoke.sh"), "--config", SMOKE_CONFIG, *run]
    smoked = subprocess.run(
        [*smoke, "dataset.dir=tokens", "run.out_dir=runs"],
        cwd=tmp_path, env=project_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=hang_bound(30),
    )  # fmt: skip
    assert smoked.returncode == 0 and "smoke: PASS (0 failed" in smoked.stdout, smoked.stdout + smoked.stderr[-3000:]
    run_dir = tmp_path / "runs" / "smoke-check"
    evaluation = [r for r in read_metrics(run_dir) if "eval_loss" in r][-1]
    assert evaluation["step"] == 40 and evaluation["eval_loss"] < math.log(512) - 1.0, evaluation

    elsewhere = tmp_path / "elsewhere"  # neither the project nor where the run was launched
    elsewhere.mkdir()
    exported = tmp_path / "exported"
    export = [sys.executable, "-m", f"{PACKAGE}.tools.export", str(run_dir), str(exported), "--format", "huggingface"]
    printed = subprocess.run(export, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=hang_bound(10))
    assert printed.returncode == 0, printed.stderr[-3000:]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    from safetensors import safe_open

    with safe_open(exported / "model.safetensors", framework="pt") as stored:
        assert "lm_head.weight" not in stored.keys()  # noqa: SIM118 (safe_open has keys(), not `in`)
    val = np.fromfile(tmp_path / "tokens" / data.SPLITS["eval"], dtype=meta["dtype"])
    windows = evaluation["eval_samples"]  # the smoke check's quick look: its first eval.limit windows
    assert windows == min(512, (len(val) - 1) // 64)
    assert window_loss(loaded, val, 64, windows) == pytest.approx(evaluation["eval_loss"], rel=1e-5)

    # the tokenizer went along: it cuts the evaluation text into the ids prepare wrote (all but the
    # last, which the text's cut may split otherwise), and names the end of text generate() stops at
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer(held_out.read_text()[:2000], add_special_tokens=False)["input_ids"]
    assert len(ids) > 200 and ids[:-1] == val[: len(ids) - 1].tolist()
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.bos_token is None and tokenizer.pad_token is None
    assert (loaded.generation_config.eos_token_id, loaded.generation_config.bos_token_id) == (0, None)
    ended = generated_texts(loaded, tokenizer, "def ", samples=20, tokens=48)
    assert all(len(new) == 48 or new[-1] == 0 for new in ended), ended  # only the end of text ends one early
    assert sum(newline in new[:-1] for new in ended) >= 10, ended  # the file's eos would have ended these early

    sample = [sys.executable, "-m", f"{PACKAGE}.tools.sample", str(run_dir), "--prompt", "def ", "--tokens=20"]
    printed = subprocess.run(sample, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=hang_bound(10))
    assert printed.returncode == 0 and printed.stdout.startswith("def "), printed.stderr[-3000:]


def generated_texts(model, tokenizer, prompt: str, samples: int, tokens: int) -> list[list[int]]:
    """The ids transformers' generate() adds to `prompt`, sampled `samples` times (seeded), one call
    each: where each stops is generate()'s own choice."""
    torch.manual_seed(0)
    prompt_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(samples):
        with torch.no_grad():
            ids = model.generate(prompt_ids, do_sample=True, max_new_tokens=tokens, pad_token_id=0)
        out.append(ids[0, prompt_ids.shape[1] :].tolist())
    return out
