"""Tiny random-weight models of real mlx_lm architectures, saved as HF directories with a real (small,
trained-in-the-test) tokenizer; and small helpers to compare models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from squishlike.model import embedding_weights, new_model

# Shapes divisible by every group size (32, 64, 128) so each tensor can take each scheme.
BASE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=384,
    rope_theta=10000.0,
    max_position_embeddings=512,
)

TINY_CONFIGS = {
    "llama": {**BASE, "model_type": "llama", "tie_word_embeddings": False},
    # qwen2 has q/k/v biases; tied embeddings.
    "qwen2": {**BASE, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
    "gemma3_text": {
        **BASE,
        "model_type": "gemma3_text",
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 10000.0,
    },
}

PROSE = (
    "The quick brown fox jumps over the lazy dog. A small model reads a short text and learns its words. "
    "What is the capital of France? The capital of France is Paris. Rivers run to the sea, and the sea is salt. "
) * 20


def make_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer trained here on a few sentences, saved as tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([PROSE], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return directory


def make_hf_model(directory: Path, config: dict, tokenizer_dir: Path, dtype=mx.float32, seed: int = 0,
                  row_spread: float = 0.0) -> Path:
    """Write a random-weight model of `config`'s architecture as an HF directory (model.safetensors + config),
    under the model's own parameter names (which its sanitize keeps, as in an mlx_lm.convert output).

    `row_spread`: the log-normal spread of the norms of the embedding and output-head rows. Trained models have
    it (frequent tokens have large rows), and it gives them confident top-1 choices; a random model with rows of
    one size has near-ties everywhere, which any rounding of its weights flips."""
    mx.random.seed(seed)
    model = new_model(config)
    heads = embedding_weights(model)
    unscaled = {f"{path}.weight": identity_weight(m) for path, m in model.named_modules()
                if "norm" in type(m).__name__.lower() and getattr(m.get("weight"), "ndim", 0) == 1}

    def randomized(name: str, v: mx.array) -> mx.array:
        if v.ndim == 1:  # random norms too, so a misplaced or dropped norm weight changes the logits
            return mx.random.normal(v.shape) * 0.1 + unscaled.get(name, 1.0)
        if not mx.any(v).item():  # zero as mlx_lm initializes it (talkie's head, some routers) hides a misplacement:
            return mx.random.normal(v.shape) * v.shape[-1] ** -0.5  # random at nn.Linear's scale
        if name in heads and row_spread:
            return v * mx.exp(row_spread * mx.random.normal((v.shape[0], 1)))
        return v

    params = {k: randomized(k, v).astype(dtype) for k, v in tree_flatten(model.parameters())}
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), params, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=1))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return directory



def identity_weight(norm) -> float:
    """The weight at which a norm layer leaves its normalized input unscaled: 1 for most; 0 for a norm that scales
    by 1 + weight (Gemma's, muse_glimmer's), or 1 - offset (plamo3's). A trained model's norms sit near it; a random
    model's norms must too: each norm at twice its identity doubles what passes, errors included."""
    weight = norm.weight
    x = mx.random.normal((1, weight.shape[0]), key=mx.random.key(0))  # leaves the seeded draws of the weights as they were
    try:
        out = {}
        for w in (0.0, 1.0):
            norm.weight = mx.full(weight.shape, w)
            out[w] = norm(x)
    except (TypeError, ValueError):  # a norm that takes more than the input (a gated one): scales by its weight
        return 1.0
    finally:
        norm.weight = weight
    # out(w) = normalized * (w + offset)
    return 1.0 - mx.mean(out[0.0] / (out[1.0] - out[0.0])).item()


def mlx_quantized(tmp_path: Path, tokenizer_dir: Path, config: dict = TINY_CONFIGS["llama"], **convert_args) -> Path:
    """A tiny random model quantized by mlx_lm.convert itself (in float32 unless `dtype` is given: fast forward
    passes on CPU)."""
    import mlx_lm

    make_hf_model(tmp_path / "hf", config, tokenizer_dir)
    mlx_lm.convert(str(tmp_path / "hf"), str(tmp_path / "mlx"), quantize=True, **convert_args)
    return tmp_path / "mlx"

def logits(model, tokens: list[int]) -> mx.array:
    return model(mx.array([tokens]))[0].astype(mx.float32)


def cosine(a: mx.array, b: mx.array) -> float:
    a, b = a.reshape(-1), b.reshape(-1)
    return (mx.sum(a * b) / (mx.linalg.norm(a) * mx.linalg.norm(b))).item()


def flat_params(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def dense_params(model) -> dict[str, mx.array]:
    """Every weight as a dense array, dequantizing quantized layers, keyed as the dense model would be."""
    out = {}
    for name, module in model.named_modules():
        if "scales" in module:  # QuantizedLinear, QuantizedEmbedding, QuantizedSwitchLinear
            out[f"{name}.weight"] = mx.dequantize(
                module.weight, module.scales, module.get("biases"), group_size=module.group_size, bits=module.bits,
                mode=getattr(module, "mode", "affine"),
            )
    for name, value in flat_params(model).items():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) or (name.endswith(".weight") and f"{prefix}.weight" in out):
            continue
        out[name] = value
    return out


def assert_same_weights(a, b) -> None:
    pa, pb = dense_params(a), dense_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        assert mx.array_equal(pa[k], pb[k]).item(), f"{k} differs between tiers"


def quantized_layouts(model) -> dict[str, tuple[int, int]]:
    """(bits, group size) of each quantized linear, by module path."""
    return {path: (module.bits, module.group_size) for path, module in model.named_modules()
            if isinstance(module, nn.QuantizedLinear)}


def assert_serves_as_store(model, store_model, tokens: list[int]) -> None:
    """`model` (mlx_lm's load of a store's export) has the store model's quantized layouts and weights, and the same
    logits, on a CPU through the store's CPU layers as the store model is."""
    from squishlike.cpu_layers import use_cpu_kernels
    from squishlike.tiers import order

    assert quantized_layouts(model) == quantized_layouts(store_model)
    assert_same_weights(store_model, model)
    if order.device_kind() == "cpu":
        use_cpu_kernels(model)
    assert mx.array_equal(logits(model, tokens), logits(store_model, tokens)).item()


QWEN2_CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
For each function call, return <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>
Call tool_call.name with its arguments.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and not enable_thinking %}
<think>

</think>
{% endif %}
{% endif %}"""

QWEN2_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|fim_prefix|>"]
QWEN2_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def disk_bytes(directory: Path) -> int:
    """The bytes of every file under `directory`: a store plus whatever caches its loads wrote."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _synthetic_merges(alphabet: list[str], vocab_size: int, seed: int) -> tuple[list[str], list[tuple]]:
    """A BPE vocabulary of `vocab_size` tokens grown from `alphabet` by random pairwise merges (short tokens
    merged more often), with the merges that produce it: a real, consistent BPE model in a second."""
    import random

    rng = random.Random(seed)
    tokens = list(alphabet)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    while len(tokens) < vocab_size:
        a = tokens[min(int(rng.expovariate(1 / 400)), len(tokens) - 1)]
        b = tokens[min(int(rng.expovariate(1 / 400)), len(tokens) - 1)]
        if (merged := a + b) not in vocab and len(merged) <= 16:
            vocab[merged] = len(tokens)
            tokens.append(merged)
            merges.append((a, b))
    return tokens, merges


def make_qwen2_tokenizer(directory: Path, vocab_size: int = 151_643) -> Path:
    """A Qwen2-style tokenizer: byte-level BPE with Qwen2's split regex and NFC, `vocab_size` entries, its special
    and added tokens, and a ChatML template with tools and thinking (synthesized merges, not trained)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    tokens, merges = _synthetic_merges(alphabet, vocab_size, seed=0)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    regex = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN2_ADDED_TOKENS])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": t in QWEN2_SPECIAL_TOKENS}
        for t in QWEN2_SPECIAL_TOKENS + QWEN2_ADDED_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "model_max_length": 131072,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "chat_template": QWEN2_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message.role }}\n{{ message.content }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def make_spm_tokenizer(directory: Path, vocab_size: int = 32_000) -> Path:
    """A SentencePiece-style (Llama/Gemma) tokenizer: BPE over "▁"-joined text with byte fallback, <0xXX> byte
    tokens, a BOS-adding post-processor, Gemma's turn markers as added tokens (synthesized merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    special = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    alphabet = list(dict.fromkeys(["\u2581", *(chr(c) for c in range(33, 127)), *"éèàüößçñ日本語中文你好世界привет"]))
    tokens, merges = _synthetic_merges(alphabet, vocab_size - len(special) - len(byte_tokens), seed=1)
    vocab = {t: i for i, t in enumerate(special + byte_tokens + tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<start_of_turn>", "<end_of_turn>")])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": None, "add_bos_token": True, "add_eos_token": False, "legacy": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 8192, "chat_template": SPM_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


# Ministral 3's text model: Llama's tensors, mlx_lm's pipeline support. Kept out of TINY_CONFIGS (which every
# per-architecture test takes) because squishlike only reads it as an HF or MLX directory or an npy-dir.
MINISTRAL3 = {
    **BASE,
    "model_type": "ministral3",
    "head_dim": 32,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                        "original_max_position_embeddings": 512},
}
