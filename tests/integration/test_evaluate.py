"""Tests for squishlike.evaluation on tiny random-weight mlx_lm llama models and a tokenizer trained in the test."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from squishlike import evaluation as ev
from squishlike import openblas

VOCAB = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_tokenizer():
    """A real BPE tokenizer trained on the shipped prose, wrapped as mlx_lm wraps tokenizers."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([ev.load_text("eval_prose"), ev.load_text("calibration")], trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return TokenizerWrapper(hf)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def make_model(seed: int = 0, vocab: int = VOCAB) -> nn.Module:
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    # Larger-than-default weights so the random model has confident, token-dependent predictions.
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def perturbed(model: nn.Module, scale: float = 0.02, seed: int = 1) -> nn.Module:
    copy = make_model(seed=0)
    mx.random.seed(seed)
    copy.update(
        tree_map(lambda p: p + scale * mx.random.normal(p.shape) * p.abs().mean(), model.parameters())
    )
    mx.eval(copy.parameters())
    return copy


class UniformModel(nn.Module):
    """Logits all zero: every token has probability 1/vocab."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return mx.zeros((*inputs.shape, self.vocab))


class BigramModel(nn.Module):
    """Logits at each position depend only on the current token: table[token]."""

    def __init__(self, table: np.ndarray):
        super().__init__()
        self.table = mx.array(table)
        self.layers: list = []  # no attention layers: generation needs no KV cache

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        return self.table[inputs]


@pytest.fixture(scope="module")
def model():
    return make_model(seed=0)


@pytest.fixture(scope="module")
def windows(tokenizer):
    return ev.token_windows(tokenizer, ev.load_text("eval_prose"), window=128, max_tokens=512)


# ------------------------------------------------------------------------------------------------ data


def test_shipped_texts_are_substantial_and_distinct():
    prose, calib = ev.load_text("eval_prose"), ev.load_text(name="calibration")
    assert 4000 <= len(prose.split()) <= 6500
    assert 1500 <= len(calib.split()) <= 2600
    prose_sentences = {s.strip() for s in prose.replace("\n", " ").split(". ") if len(s) > 30}
    calib_sentences = {s.strip() for s in calib.replace("\n", " ").split(". ") if len(s) > 30}
    assert not prose_sentences & calib_sentences
    prompts = ev.load_prompts()
    assert 8 <= len(prompts) <= 20 and all(p.strip() for p in prompts)
    with pytest.raises(ValueError):
        ev.load_text("nope")


# ------------------------------------------------------------------------------------------------ windows


def test_token_windows_cover_every_token_once(tokenizer):
    text = ev.load_text("calibration")
    ids = tokenizer.encode(text)
    for window, stride in [(64, None), (64, 48), (64, 1), (100, 100)]:
        wins = ev.token_windows(tokenizer, text, window=window, stride=stride, max_tokens=300)
        assert all(2 <= len(w.tokens) <= window and w.first_target >= 1 for w in wins)
        # Rebuild the absolute index of every scored target: strictly increasing, within the first 300 tokens.
        scored: list[int] = []
        start = 0
        step = window if stride is None else stride
        for w in wins:
            assert list(w.tokens) == ids[start : start + len(w.tokens)]
            scored += range(start + w.first_target, start + len(w.tokens))
            start += step
        assert scored == sorted(set(scored)) and scored[-1] == 299
        if stride is not None and stride < window:
            assert scored == list(range(1, 300))  # overlapping: every token but the first is scored once
        else:
            assert len(scored) == 300 - len(wins)  # non-overlapping: each window's first token is context only
    assert len(ev.token_windows(tokenizer, text, window=64, max_tokens=None)[-1].tokens) >= 1


# ------------------------------------------------------------------------------------------------ perplexity


def test_perplexity_of_uniform_model_is_vocab_size(windows):
    assert ev.perplexity(UniformModel(VOCAB), windows) == pytest.approx(VOCAB, rel=1e-5)


def test_perplexity_matches_hand_computed_nll():
    rng = np.random.default_rng(0)
    vocab = 7
    table = rng.normal(size=(vocab, vocab)).astype(np.float32) * 2
    seqs = [[0, 3, 5, 1, 6], [2, 2, 4]]
    nll = []
    for seq in seqs:
        for prev, nxt in zip(seq[:-1], seq[1:]):
            row = table[prev].astype(np.float64)
            nll.append(-(row[nxt] - math.log(np.exp(row).sum())))
    expected = math.exp(sum(nll) / len(nll))
    assert ev.perplexity(BigramModel(table), seqs) == pytest.approx(expected, rel=1e-5)
    # Context-only tokens are not scored: scoring only the last target of the first sequence.
    row = table[1].astype(np.float64)
    only_last = math.exp(-(row[6] - math.log(np.exp(row).sum())))
    assert ev.perplexity(BigramModel(table), [ev.Window((0, 3, 5, 1, 6), 4)]) == pytest.approx(only_last, rel=1e-5)


# ------------------------------------------------------------------------------------------------ compare


def test_compare_model_with_itself(model, windows):
    result = ev.compare(model, model, windows)
    assert result["top1_agreement"] == 1.0
    assert abs(result["kl_mean"]) < 1e-6 and abs(result["kl_max"]) < 1e-5
    assert result["perplexity"] == result["reference_perplexity"]
    assert result["perplexity"] == pytest.approx(ev.perplexity(model, windows), rel=1e-6)
    assert result["positions"] == sum(w.n_scored for w in windows)


def test_compare_with_perturbed_model(model, windows):
    other = perturbed(model)
    result = ev.compare(other, model, windows)
    assert 0.0 < result["top1_agreement"] < 1.0
    assert result["kl_mean"] > 1e-3
    assert result["perplexity"] != result["reference_perplexity"]
    assert result["reference_perplexity"] == pytest.approx(ev.perplexity(model, windows), rel=1e-6)
    # A larger perturbation agrees less and diverges more.
    worse = ev.compare(perturbed(model, scale=0.1), model, windows)
    assert worse["top1_agreement"] < result["top1_agreement"] and worse["kl_mean"] > result["kl_mean"]
    # KL against a numpy computation on the first window.
    w = windows[0]
    lp = [np.asarray(ev.window_logprobs(m, w)[0], dtype=np.float64) for m in (other, model)]
    kl_np = (np.exp(lp[1]) * (lp[1] - lp[0])).sum(-1)
    one = ev.compare(other, model, [w])
    assert one["kl_mean"] == pytest.approx(kl_np.mean(), rel=1e-3)


def test_compare_with_a_reference_cache(model, windows):
    """Many candidates against one reference: the cached reference gives the same figures, and refuses other windows."""
    cache = ev.ReferenceCache(model, windows)
    for candidate in (perturbed(model), perturbed(model, scale=0.1)):
        assert ev.compare(candidate, cache, windows) == ev.compare(candidate, model, windows)
    with pytest.raises(ValueError, match="other windows"):
        ev.compare(model, cache, windows[:1])


# ------------------------------------------------------------------------------------------------ greedy


def test_greedy_agreement(model, tokenizer):
    prompts = ev.load_prompts()[:3]
    assert ev.greedy_agreement(model, model, tokenizer, prompts, max_tokens=8) == 1.0
    assert ev.greedy_agreement(model, model, tokenizer, prompts, max_tokens=8, batched=False) == 1.0
    outs = ev.greedy_generations(model, tokenizer, prompts, max_tokens=8)
    assert all(1 <= len(o) <= 9 for o in outs)
    assert outs == ev.greedy_generations(model, tokenizer, prompts, max_tokens=8, batched=False)
    assert ev.sequence_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert ev.sequence_agreement([[1, 2], [5]], [[1, 2, 3], [5]]) == 0.75
    far = make_model(seed=7)
    assert ev.greedy_agreement(far, model, tokenizer, prompts, max_tokens=8) < 1.0


def test_greedy_records_stop(tokenizer):
    """A model that always predicts EOS stops at once: its continuation is just the STOP marker."""
    eos = tokenizer.eos_token_id
    table = np.full((VOCAB, VOCAB), -10.0, dtype=np.float32)
    table[:, eos] = 10.0
    stopper = BigramModel(table)
    for batched in (True, False):
        outs = ev.greedy_generations(stopper, tokenizer, ["Hi", "Why?"], max_tokens=5, batched=batched)
        assert outs == [[ev.STOP], [ev.STOP]]
    assert ev.decode_generation(tokenizer, [ev.STOP]) == ""


def test_prepare_for_eval_dequantizes(tokenizer, windows):
    quantized = make_model(seed=3)
    nn.quantize(quantized, group_size=64, bits=4)
    ppl_quantized = ev.perplexity(quantized, windows[:1])
    plain = ev.prepare_for_eval(quantized)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in plain.named_modules())
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(plain.parameters()))
    assert ev.perplexity(plain, windows[:1]) == pytest.approx(ppl_quantized, rel=1e-3)


# ------------------------------------------------------------------------------------------------ gate


def test_text_perplexity(model, tokenizer):
    windows = ev.token_windows(tokenizer, ev.load_text("calibration"), window=256, max_tokens=600)
    ppl = ev.text_perplexity(model, tokenizer, window=256, max_tokens=600)
    assert ppl == pytest.approx(ev.perplexity(model, windows), rel=1e-6)


def test_gate_around_the_bound():
    assert ev.passes_gate(10.0, 10.0)
    assert ev.passes_gate(10.79, 10.0)
    assert ev.passes_gate(10.8, 10.0)
    assert not ev.passes_gate(10.81, 10.0)
    assert not ev.passes_gate(11.0, 10.0, max_increase=0.05)
    assert ev.passes_gate(9.0, 10.0)
    assert not ev.passes_gate(float("nan"), 10.0)
    assert not ev.passes_gate(float("inf"), 10.0)


# ------------------------------------------------------------------------------------------------ end to end


def test_evaluate_end_to_end(tmp_path, model, tokenizer, capsys):
    from mlx_lm.utils import save_config, save_model

    for name, m in [("a", model), ("b", perturbed(model))]:
        d = tmp_path / name
        d.mkdir()
        save_model(d, m)
        save_config({k: v for k, v in vars(m.args).items() if v is not None}, d / "config.json")
        tokenizer._tokenizer.save_pretrained(d)
    result = ev.evaluate(tmp_path / "a", max_tokens=300, window=128)
    assert capsys.readouterr().out == ""  # the caller prints the result (`squishlike eval` as text or JSON)
    assert json.loads(json.dumps(result))["perplexity"] == result["perplexity"] and result["reference"] is None
    assert result["perplexity"] == pytest.approx(ev.perplexity(model, ev.token_windows(
        tokenizer, ev.load_text(), window=128, max_tokens=300)), rel=1e-5)

    # The reference defaults to the source recorded in the manifest, as compress records it.
    source = {"path": str(tmp_path / "a"), "format": "safetensors", "fingerprint": "0" * 64}
    (tmp_path / "b" / "manifest.json").write_text(json.dumps({"source": source}))
    result = ev.evaluate(tmp_path / "b", max_tokens=300, window=128, gen_tokens=4, prompts=["Hi"], quiet=True)
    assert result["reference"] == str(tmp_path / "a")
    assert 0.0 < result["top1_agreement"] < 1.0 and result["kl_mean"] > 0
    assert 0.0 <= result["greedy_agreement"] <= 1.0
    assert result["perplexity_increase"] == pytest.approx(
        result["perplexity"] / result["reference_perplexity"] - 1.0)
    assert "top-1 agreement" in ev.format_report(result)
    json.dumps(result)


def test_reexec_with_openblas(monkeypatch):
    calls = []
    monkeypatch.setattr(openblas.os, "execve", lambda *args: calls.append(args))
    monkeypatch.setattr(openblas, "find_openblas", lambda: "/lib/libopenblas.so.0")
    monkeypatch.delenv("SQUISHLIKE_OPENBLAS", raising=False)
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    openblas.reexec_with_openblas(["eval", "m"])
    assert len(calls) == 1
    exe, argv, env = calls[0]
    assert argv[1:] == ["-m", "squishlike", "eval", "m"]
    assert env["LD_PRELOAD"] == "/lib/libopenblas.so.0:/lib/other.so" and env["SQUISHLIKE_OPENBLAS"] == "0"
    assert env["OPENBLAS_THREAD_TIMEOUT"] == openblas.THREAD_TIMEOUT  # idle threads sleep instead of spinning
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "20")  # unless the user chose
    openblas.reexec_with_openblas(["eval", "m"])
    assert calls[1][2]["OPENBLAS_THREAD_TIMEOUT"] == "20"
    calls.pop()
    monkeypatch.setenv("LD_PRELOAD", "/lib/libopenblas.so.0")  # already preloaded: nothing to do
    openblas.reexec_with_openblas(["eval", "m"])
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv("SQUISHLIKE_OPENBLAS", "0")  # opted out (or already restarted once)
    openblas.reexec_with_openblas(["eval", "m"])
    monkeypatch.setattr(openblas, "find_openblas", lambda: None)
    monkeypatch.delenv("SQUISHLIKE_OPENBLAS")
    openblas.reexec_with_openblas(["eval", "m"])
    assert len(calls) == 1


def test_greedy_generations_of_a_model_that_cannot_batch(tmp_path, tokenizer_dir):
    """mlx_lm's gemma2 cannot take a batch (its attention's mask does not broadcast over the batch's heads):
    the greedy continuations are then taken prompt by prompt, the same tokens, where `squishlike eval` stopped."""
    import squishlike
    from support.arch_sweep import HAND
    from support.tiny_models import make_hf_model

    src = make_hf_model(tmp_path / "gemma2", HAND["gemma2"], tokenizer_dir)
    model, tokenizer = squishlike.load(src)
    prompts = ev.load_prompts()[:3]
    outs = ev.greedy_generations(model, tokenizer, prompts, max_tokens=4)
    assert len(outs) == 3 and outs == ev.greedy_generations(model, tokenizer, prompts, max_tokens=4, batched=False)
