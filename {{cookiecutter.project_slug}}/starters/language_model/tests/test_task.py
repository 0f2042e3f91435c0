"""The language model's task: windows, the model, prepare, sample, FLOPs; and a real training run."""

import email
import json
import math
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PACKAGE, PROJECT, SMOKE_CONFIG, project_env, read_metrics, torchrun, train_args
from test_faults import assert_bit_identical, final_state

from {{ cookiecutter.package_name }} import config, data, task
from {{ cookiecutter.package_name }}.base import batching
from {{ cookiecutter.package_name }}.base.dist import DistInfo
from {{ cookiecutter.package_name }}.loop import loaders, parallel, preflight
from {{ cookiecutter.package_name }}.model import training_flops_per_token
from {{ cookiecutter.package_name }}.tools import prepare, sample

CPU = DistInfo(0, 0, 1, 1, torch.device("cpu"), "none")


def small_config(*overrides):
    return config.load(SMOKE_CONFIG, [*overrides])


def test_samples_are_consecutive_windows_with_targets_shifted_by_one():
    cfg = small_config()
    train_set, eval_set = task.build_datasets(cfg)
    context = cfg.model.context
    (x0, y0), (x1, _) = train_set[0], train_set[1]
    assert x0.shape == y0.shape == (context,) and x0.dtype == torch.int64
    assert torch.equal(x0[1:], y0[:-1]) and torch.equal(x1[0:1], y0[-1:])  # window 1 starts where 0 ended
    corpus = data.built_in_corpus()
    assert bytes(x0.tolist()) == corpus[:context]
    assert len(train_set) + len(eval_set) in range(len(corpus) // context - 2, len(corpus) // context + 1)


def test_the_seam_sums_the_loss_over_tokens_and_passes_its_preflight():
    cfg = small_config()
    model = task.build_model(cfg)
    train_set, eval_set = task.build_datasets(cfg)
    train_loader, eval_loader = loaders.build_loaders(train_set, eval_set, cfg, CPU, 0)
    preflight.check_task(model, (train_set, train_loader), (eval_set, eval_loader))
    batch = batching.first_samples(train_set, train_loader, 3)
    logits = model(batch[0])
    mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
    assert task.count_terms(batch) == 3 * cfg.model.context
    assert torch.allclose(task.loss_sum(model, batch), mean * 3 * cfg.model.context)
    assert math.isclose(mean.item(), math.log(256), rel_tol=0.05)  # GPT-2 init: a near-uniform first guess
    sums = task.eval_sums(model, batch)
    assert sums["tokens"].tolist() == [cfg.model.context] * 3
    results = task.metrics({"loss": 6.0, "tokens": 3.0, "samples": 1.0})
    assert results == {"loss": 2.0, "perplexity": math.exp(2.0)}


def test_the_model_ties_its_head_and_is_causal():
    cfg = small_config("model.dropout=0")
    model = task.build_model(cfg).eval()
    assert model.head.weight is model.tokens.weight
    tokens = torch.randint(0, 256, (1, cfg.model.context))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    with torch.no_grad():  # the last token cannot change what comes before it
        assert torch.equal(model(tokens)[0, :-1], model(changed)[0, :-1])


def test_a_width_that_heads_do_not_divide_is_a_config_error():
    with pytest.raises(config.ConfigError, match="model.width: 64 is not a multiple of model.heads"):
        task.build_model(small_config("model.heads=3"))


def test_training_flops_per_token_match_a_hand_count():
    model = task.build_model(small_config())  # 2 layers, width 64, context 64, 256 byte tokens
    tokens = 256 * 64  # the tied matrix, counted once (it multiplies as the output head)
    block = 2 * 2 * 64 + 64 * 192 + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)  # norms, qkv, out, MLP
    weights = tokens + 2 * block + 2 * 64  # + the final norm; the position table is looked up, not multiplied
    attention = 2 * 2 * 2 * 64 * 64  # per token, per layer: scores q.k and the weighted sum of v, 2 FLOPs each
    assert training_flops_per_token(model) == 3 * (2 * weights + attention) == 794_880
    assert task.throughput(small_config(), model).per_sample == 64


def test_prepare_writes_memmapped_tokens_that_train_like_the_built_in_corpus(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello, world\n" * 500)
    meta = prepare.prepare([text], tmp_path / "tokens", eval_share=0.2)
    assert meta["dtype"] == "uint16" and meta["vocabulary_size"] == 256 and meta["tokenizer"] == "bytes"
    assert meta["tokens"] == {"train": 5200, "eval": 1300}
    cfg = small_config(f"dataset.dir={tmp_path / 'tokens'}")
    train_set, eval_set = task.build_datasets(cfg)
    assert bytes(train_set[0][0].tolist()) == text.read_bytes()[: cfg.model.context]
    assert len(train_set) == (5200 - 1) // cfg.model.context
    assert pickle.loads(pickle.dumps(train_set)).tokens.mapped is None  # a worker maps the file itself
    assert task.build_model(cfg).tokens.num_embeddings == 256


def test_another_tokenizer_plugs_in_by_name(tmp_path, monkeypatch):
    (tmp_path / "wordtokens.py").write_text(
        "class Words:\n"
        "    n_vocab = 70000\n"
        "    def encode(self, text):\n"
        "        return [69999 if w == 'b' else len(w) for w in text.split()]\n"
        "    def decode(self, ids):\n"
        "        return ' '.join('b' if i == 69999 else 'a' * i for i in ids)\n"
        "words = Words()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    text = tmp_path / "text.txt"
    text.write_text("a bb b " * 400)
    meta = prepare.prepare([text], tmp_path / "tokens", 0.25, "wordtokens:words")
    assert meta["dtype"] == "uint32" and meta["vocabulary_size"] == 70000  # beyond uint16
    tokens = np.fromfile(tmp_path / "tokens" / "train.bin", dtype=np.uint32)
    assert tokens[:3].tolist() == [1, 2, 69999]
    cfg = small_config(f"dataset.dir={tmp_path / 'tokens'}")
    assert task.build_model(cfg).tokens.num_embeddings == 70000


def test_prepare_keeps_the_evaluation_files_out_of_the_training_tokens_and_records_absolute_sources(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    Path("train.txt").write_text("training text\n" * 100)
    Path("eval.txt").write_text("held-out text\n" * 10)
    assert prepare.main(["train.txt", "--eval", "eval.txt", "--out", "tokens"]) == 0  # the command, in this process
    assert capsys.readouterr().out.startswith("1,400 training and 140 evaluation tokens (bytes, vocabulary 256)")
    for name, text in (("train.bin", "train.txt"), ("val.bin", "eval.txt")):  # every byte of each, in one file only
        assert bytes(np.fromfile(Path("tokens") / name, dtype=np.uint16).tolist()) == Path(text).read_bytes()
    meta = json.loads(Path("tokens/meta.json").read_text())
    assert meta["tokens"] == {"train": 1400, "eval": 140}
    assert meta["sources"] == {"train": [str(tmp_path / "train.txt")], "eval": [str(tmp_path / "eval.txt")]}
    with pytest.raises(config.ConfigError, match="--eval-share and --eval: pass one of them"):
        prepare.prepare([Path("train.txt")], Path("other"), 0.2, eval_files=[Path("eval.txt")])


def test_prepare_records_the_ids_of_the_tokenizers_begin_end_and_padding_tokens(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers", reason="the huggingface extra: pip install -e '.[huggingface]'")
    text = tmp_path / "text.txt"
    text.write_text("def x return x\n" * 100)
    words = {"[UNK]": 0, "<pad>": 1, "<s>": 2, "</s>": 3, "<|endoftext|>": 4, "def": 5, "return": 6, "x": 7}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["[UNK]", "<pad>", "<s>", "</s>", "<|endoftext|>"])
    tokenizer.save(str(tmp_path / "words.json"))
    (tmp_path / "others.py").write_text(
        "class Tiktoken:  # an end-of-text token only, as tiktoken's encodings\n"
        "    n_vocab, eot_token = 10, 9\n"
        "    def encode(self, text):\n"
        "        return [len(word) for word in text.split()]\n"
        "class Transformers:  # transformers' tokenizers name three; one here lies outside the vocabulary\n"
        "    vocab_size, bos_token_id, eos_token_id, pad_token_id = 10, 10, 8, 0\n"
        "    encode = Tiktoken.encode\n"
        "tiktoken, transformers = Tiktoken(), Transformers()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    recorded = {
        str(tmp_path / "words.json"): {"bos": 2, "eos": 3, "pad": 1},  # </s> before <|endoftext|>
        "others:tiktoken": {"bos": None, "eos": 9, "pad": None},
        "others:transformers": {"bos": None, "eos": 8, "pad": 0},
        None: {"bos": None, "eos": None, "pad": None},  # bytes
    }
    for name, ids in recorded.items():
        assert prepare.prepare([text], tmp_path / "tokens", 0.2, name)["special_tokens"] == ids, name
        cfg = small_config(f"dataset.dir={tmp_path / 'tokens'}")
        assert data.special_tokens(cfg) == ids and data.pack_facts(cfg)["special_tokens"] == ids, name
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    del meta["special_tokens"]  # data prepared before prepare recorded them
    (tmp_path / "tokens" / "meta.json").write_text(json.dumps(meta))
    assert data.special_tokens(small_config(f"dataset.dir={tmp_path / 'tokens'}")) == recorded[None]
    assert data.special_tokens(small_config()) == recorded[None]  # the built-in corpus: bytes
    packed = {**data.pack_facts(small_config()), "special_tokens": recorded["others:transformers"]}
    monkeypatch.setattr(data.packs, "facts", lambda cfg: packed)  # what the pack command recorded
    assert data.special_tokens(small_config(f"data.shards={tmp_path / 'shards'}")) == recorded["others:transformers"]


def test_a_tokenizer_json_is_copied_beside_the_data_and_read_from_there(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the huggingface extra: pip install -e '.[huggingface]'")
    words = {"[UNK]": 0, "def": 1, "return": 2, "x": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "words.json"))
    text = tmp_path / "text.txt"
    text.write_text("def x return x y\n" * 100)
    meta = prepare.prepare([text], tmp_path / "tokens", 0.2, str(tmp_path / "words.json"))
    assert meta["tokenizer"] == "tokenizer.json" and meta["vocabulary_size"] == 4
    assert np.fromfile(tmp_path / "tokens" / "train.bin", dtype=np.uint16)[:5].tolist() == [1, 3, 2, 3, 0]
    (tmp_path / "words.json").unlink()  # the data's own copy is what training and sample read
    cfg = small_config(f"dataset.dir={tmp_path / 'tokens'}")
    assert data.tokenizer_file(cfg) == tmp_path / "tokens" / "tokenizer.json"
    assert prepare.load_tokenizer(data.tokenizer_name(cfg)).decode([1, 3]) == "def x"
    assert task.build_model(cfg).tokens.num_embeddings == 4


def test_a_missing_token_directory_names_the_prepare_command(tmp_path):
    cfg = small_config(f"dataset.dir={tmp_path}")
    with pytest.raises(config.ConfigError, match=f"dataset.dir: {tmp_path} has no meta.json; write it with"):
        task.build_datasets(cfg)


def test_after_a_swap_prepare_and_sample_stop_with_one_line_saying_what_to_adapt(tmp_path, monkeypatch, capsys):
    monkeypatch.delattr(data, "SPLITS")  # a data.py of your own: no token files
    with pytest.raises(SystemExit) as stopped:
        prepare.main(["--out", str(tmp_path / "tokens")])
    assert stopped.value.code == 2 and capsys.readouterr().err == (
        "config error: tools.prepare works with the language-model starter's data.py (token files, a tokenizer), "
        "and yours has no SPLITS: adapt tools/prepare.py to your data, or delete it\n"
    )
    monkeypatch.undo()
    cfg = config.load(SMOKE_CONFIG)
    saved = tmp_path / "step_00000001.pt"
    torch.save({"config": config.to_dict(cfg), "model": torch.nn.Linear(2, 2).state_dict()}, saved)
    monkeypatch.setattr(task, "build_model", lambda cfg: torch.nn.LSTM(2, 2))  # a model of your own: no context
    with pytest.raises(SystemExit) as stopped:
        sample.main([str(saved), "--tokens", "3"])
    assert stopped.value.code == 2 and "and yours has neither: adapt generate()" in capsys.readouterr().err


def test_generate_returns_the_tokens_asked_for_and_greedy_is_repeatable():
    model = task.build_model(small_config())
    first = sample.generate(model, [100, 101], tokens=70, temperature=0, top_k=None)
    assert len(first) == 70 and first == sample.generate(model, [100, 101], 70, 0, None)  # beyond the context
    drawn = sample.generate(model, [100], 5, 1.0, 3, torch.Generator().manual_seed(0))
    assert len(drawn) == 5 and all(0 <= t < 256 for t in drawn)


def unigram_entropy(path) -> float:
    """Nats per byte of a file under its own byte frequencies: what a model that ignores context gets."""
    counts = Counter(path.read_bytes())
    total = sum(counts.values())
    return -sum(n / total * math.log(n / total) for n in counts.values())


@pytest.mark.task
def test_prepare_train_and_sample_on_real_text(tmp_path):
    """Python's own email package sources (on every machine, not written for this test): a
    small model must beat the text's unigram entropy clearly, and sample from its checkpoint."""
    sources = sorted(Path(email.__file__).parent.glob("*.py"))
    corpus = tmp_path / "email.py.txt"
    corpus.write_bytes(b"".join(path.read_bytes() for path in sources))
    env = project_env()
    prepared = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.tools.prepare", str(corpus), "--out", str(tmp_path / "tokens")],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "train with dataset.dir=" in prepared.stdout
    overrides = [f"dataset.dir={tmp_path / 'tokens'}", "train.max_steps=240", "train.precision=fp32", "run.name=lm"]
    torchrun(*train_args(tmp_path, *overrides, "checkpoint.every_steps=200"), timeout=300)
    final = [r for r in read_metrics(tmp_path / "lm") if "eval_loss" in r][-1]
    assert final["eval_loss"] < unigram_entropy(corpus) - 0.4, final
    record = next(r for r in read_metrics(tmp_path / "lm") if "tokens_per_s" in r)
    assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * 64)
    assert "mfu" not in record  # no peak figure on a CPU: n/a, never a made-up one

    run_dir = str(tmp_path / "lm")
    printed = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.tools.sample", run_dir, "--prompt", "def ", "--tokens", "80", "--seed", "1"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert printed.stdout.startswith("def ") and len(printed.stdout.encode()) > 80  # a broken byte prints as 3
    model, tokenizer = sample.load(tmp_path / "lm", torch.device("cpu"))
    assert len(sample.generate(model, tokenizer.encode("def "), 80, 0.8, 40)) == 80

    # packed (one token window a record), its last 40 steps again: the same losses and weights,
    # without dataset.dir's files
    packed = tmp_path / "packed"
    command = [sys.executable, "-m", f"{PACKAGE}.tools.pack", str(packed), "--config", SMOKE_CONFIG, overrides[0]]
    subprocess.run(command, cwd=PROJECT, env=env, capture_output=True, timeout=120, check=True)
    (tmp_path / "tokens" / "train.bin").unlink()
    on_shards = [*overrides[1:-1], "run.name=lm-shards", f"data.shards={packed}", "data.shards_order=shuffle"]
    from_200 = f"checkpoint.resume={tmp_path / 'lm' / 'checkpoints' / 'step_00000200.pt'}"
    resumed = torchrun(*train_args(tmp_path, *on_shards, from_200), timeout=300)
    assert "at step 200" in resumed.stdout
    tokens_run, shards_run = (final_state(tmp_path / run, 240) for run in ("lm", "lm-shards"))
    assert_bit_identical(shards_run["model"], tokens_run["model"], "model")
    tokens_loss, shards_loss = (
        [r["eval_loss"] for r in read_metrics(tmp_path / run) if "eval_loss" in r and r["step"] >= 200]
        for run in ("lm", "lm-shards")
    )
    assert shards_loss == tokens_loss and shards_loss
    assert sample.load(tmp_path / "lm-shards", torch.device("cpu"))[1].decode(tokenizer.encode("def ")) == "def "


needs_fsdp = pytest.mark.skipif(bool(parallel.floor_problem()), reason=parallel.floor_problem() or "")


@needs_fsdp
@pytest.mark.task
def test_under_fsdp_each_rank_holds_half_the_state_of_a_larger_model_as_estimated(tmp_path):
    # the fast tier's fsdp proofs measure the smoke-sized model; this one is about 6x its parameters
    proofs = str(PROJECT / "tests" / "dist_proofs.py")
    result = torchrun(proofs, str(tmp_path), "--only", "memory", "model.layers=4", "model.width=128", timeout=180)
    assert "memory proofs on 2 ranks: PASS" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
    measured = json.loads((tmp_path / "memory-2.json").read_text())
    assert measured["parameters"] > 500_000
    assert max(measured["held_bytes"]) <= 0.55 * measured["ddp_bytes"]
