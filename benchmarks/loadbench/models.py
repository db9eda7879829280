"""The benchmark's source models: the embedded SmolLM2-135M as an MLX bf16 directory, and a directory with the
exact shapes of a 1.5B Qwen2 and random bf16 weights; and mlx_lm's own quantized conversions of a source, the
models an MLX user would load instead. Each is built once, atomically, and reused."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path


QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
    "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "max_window_layers": 28, "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
# Qwen2.5-7B's shapes (the most common size on a 16 GB Mac): 7.6 B parameters, 15.2 GB of bf16, head untied.
QWEN_7B = {**QWEN_1_5B, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False, "max_window_layers": 28}
# Qwen1.5-MoE-A2.7B's shapes: 14.3 B parameters (60 experts of 1,408 columns a layer, 4 routed a token, and a
# shared expert), 28.6 GB of bf16, the experts one tensor each as in its HF checkpoint.
QWEN_MOE_A2_7B = {**QWEN_1_5B, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                  "hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 5632, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "tie_word_embeddings": False, "max_window_layers": 21,
                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": False,
                  "mlp_only_layers": []}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _qwen_tensors(c: dict):
    h, inter, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    kv_rows = kv * (h // heads)
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        for proj, rows in (("q", h), ("k", kv_rows), ("v", kv_rows)):
            yield p + f"self_attn.{proj}_proj.weight", (rows, h)
            yield p + f"self_attn.{proj}_proj.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        if "num_experts" in c:  # qwen2_moe: routed experts, a shared expert and its gate
            yield p + "mlp.gate.weight", (c["num_experts"], h)
            for e in range(c["num_experts"]):
                yield from _mlp(f"{p}mlp.experts.{e}.", h, c["moe_intermediate_size"])
            yield from _mlp(f"{p}mlp.shared_expert.", h, c["shared_expert_intermediate_size"])
            yield p + "mlp.shared_expert_gate.weight", (1, h)
        else:
            yield from _mlp(f"{p}mlp.", h, inter)
    yield "model.norm.weight", (h,)
    if not c.get("tie_word_embeddings", True):
        yield "lm_head.weight", (c["vocab_size"], h)


def _mlp(prefix: str, h: int, inter: int):
    yield prefix + "gate_proj.weight", (inter, h)
    yield prefix + "up_proj.weight", (inter, h)
    yield prefix + "down_proj.weight", (h, inter)


def _built(dest: Path) -> bool:
    """Whether a benchmark input was built completely (see _build_into)."""
    return (dest / ".complete").is_file()


@contextlib.contextmanager
def _build_into(dest: Path):
    """Build a benchmark input in a temporary sibling of `dest` (yielded, not created); only when the body finishes
    is it marked complete and renamed to `dest`, so an interrupted build is redone, never half used."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    (tmp / ".complete").write_text("")
    os.replace(tmp, dest)


def build_qwen_like(dest: Path, tokenizer_from: Path | None, config: dict = QWEN_1_5B, seed: int = 0) -> Path:
    """An HF directory with the exact shapes of a Qwen2-class model and random bf16 weights (N(0, 0.02), norms 1).

    Values are drawn once into a 64 MiB pool and each tensor takes a slice at a random offset: load and compress
    times depend on sizes and dtypes, not on the values, and this builds 3 GB in seconds."""
    import numpy as np

    dest = Path(dest)
    if _built(dest):
        return dest
    with _build_into(dest) as tmp:
        tmp.mkdir(parents=True)
        rng = np.random.default_rng(seed)
        bits = (rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).view(np.uint32)
        pool = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even bf16
        tensors = list(_qwen_tensors(config))
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in tensors:
            n = math.prod(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(tmp / "model.safetensors", "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for name, shape in tensors:
                n = math.prod(shape)
                if len(shape) == 1:
                    f.write((np.full(n, 0x3F80, np.uint16) if "norm" in name else pool[:n]).tobytes())
                    continue
                start = int(rng.integers(0, len(pool)))
                while n:
                    take = min(n, len(pool) - start)
                    f.write(memoryview(pool[start:start + take]))
                    n -= take
                    start = 0
            os.fsync(f.fileno())
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_from / name).is_file():
                    shutil.copy2(tokenizer_from / name, tmp / name)
        else:
            _small_tokenizer(tmp)
    return dest


def _small_tokenizer(dest: Path) -> None:
    """A small byte-level BPE trained on the shipped calibration text, for when SmolLM2 is not installed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from squishlike.evaluation import load_text

    text = load_text("calibration")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}))


def build_smollm_source(dest: Path) -> Path:
    """The embedded SmolLM2-135M (GGUF) as an MLX directory in bfloat16, its release dtype: mlx_lm.load's input."""
    from squishlike.default_model import default_model_path

    return build_bf16_source(default_model_path(), dest)


def build_bf16_source(model: Path | str, dest: Path) -> Path:
    """Any model squishlike reads (a GGUF file above all) as an MLX directory in bfloat16: what mlx_lm.load,
    `mlx_lm.convert` and mlx_lm's GPTQ take, so that every method quantizes the same values."""
    dest = Path(dest)
    if _built(dest):
        return dest
    import mlx.core as mx

    import squishlike

    with _build_into(dest) as tmp:
        squishlike.export(model, "mlx", tmp)
        for f in sorted(tmp.glob("model*.safetensors")):
            weights, metadata = mx.load(str(f), return_metadata=True)
            if any(v.dtype == mx.float32 for v in weights.values()):  # a GGUF dequantizes to float32
                weights = {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in weights.items()}
                mx.save_safetensors(str(f), weights, metadata=metadata or {"format": "mlx"})
            del weights
    return dest


def build_mlx_lm_conversion(source: Path, dest: Path, bits: int) -> Path:
    """`mlx_lm.convert -q --q-bits BITS --q-group-size 64` of `source`: the baseline a user would otherwise load."""
    dest = Path(dest)
    if _built(dest):
        return dest
    import mlx_lm

    with _build_into(dest) as tmp:
        mlx_lm.convert(str(source), str(tmp), quantize=True, q_bits=bits, q_group_size=64)
    return dest
