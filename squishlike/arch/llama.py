"""Llama (and Mistral, which mlx_lm runs as Llama): the rule table the other decoder families build on.

llama.cpp's converter permutes the rows of Q and K inside each head (HF rotates the two halves of a head, ggml's
"normal" RoPE rotates adjacent pairs), so a Llama GGUF needs the inverse permutation before mlx_lm can use it.
Without it the model still runs, but its perplexity is ~10x worse.
"""

from __future__ import annotations

from . import Adapter, Architecture, HeadCounts, Need, Rule, rule

EMBEDDING = rule("token_embedding.weight", "model.embed_tokens.weight", "token_embd.weight")
ATTENTION_NORM = rule(
    "layers.{n}.attention_norm.weight", "model.layers.{n}.input_layernorm.weight", "blk.{n}.attn_norm.weight"
)
FFN_NORM = rule(
    "layers.{n}.ffn_norm.weight", "model.layers.{n}.post_attention_layernorm.weight", "blk.{n}.ffn_norm.weight"
)
QK_NORMS = [
    rule(
        f"layers.{{n}}.attention.{x}_norm.weight",
        f"model.layers.{{n}}.self_attn.{x}_norm.weight",
        f"blk.{{n}}.attn_{x}_norm.weight",
    )
    for x in "qk"
]
OUTPUT = [
    rule("output_norm.weight", "model.norm.weight", "output_norm.weight"),
    rule("output.weight", "lm_head.weight", "output.weight", need=Need.WHEN_UNTIED),
]


def attention(bias: Need) -> list[Rule]:
    """Q, K, V (weights, and biases as `bias` says) and the output projection."""
    rows = [
        rule(
            f"layers.{{n}}.attention.{x}.{part}",
            f"model.layers.{{n}}.self_attn.{x}_proj.{part}",
            f"blk.{{n}}.attn_{x}.{part}",
            need=need,
        )
        for x in "qkv"
        for part, need in (("weight", Need.ALWAYS), ("bias", bias))
    ]
    output = rule(
        "layers.{n}.attention.output.weight", "model.layers.{n}.self_attn.o_proj.weight", "blk.{n}.attn_output.weight"
    )
    return [*rows, output]


def ffn(bias: Need) -> list[Rule]:
    """The gated MLP: gate, up, down (weights, and biases as `bias` says)."""
    return [
        rule(
            f"layers.{{n}}.ffn.{x}.{part}", f"model.layers.{{n}}.mlp.{x}_proj.{part}", f"blk.{{n}}.ffn_{x}.{part}",
            need=need,
        )
        for x in ("gate", "up", "down")
        for part, need in (("weight", Need.ALWAYS), ("bias", bias))
    ]


def permute_for_gguf(w, heads: int):
    """HF -> GGUF row order of Q or K (llama.cpp convert_hf_to_gguf `LlamaModel.permute`), weights or biases."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_gguf(w, heads: int):
    """GGUF -> HF row order of Q or K: the inverse of `permute_for_gguf`."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(canonical: str, config: HeadCounts) -> int:
    # Q has one block of rows per attention head, K one per key/value head.
    return config.num_attention_heads if ".attention.q." in canonical else config.num_key_value_heads


QK_PERMUTATION = Adapter(
    naming="gguf",
    pattern=r"layers\.\d+\.attention\.[qk]\.(weight|bias)",
    to_canonical=lambda name, w, config: unpermute_from_gguf(w, _heads(name, config)),
    from_canonical=lambda name, w, config: permute_for_gguf(w, _heads(name, config)),
)

# Not in the table, so never read: `self_attn.rotary_emb.inv_freq` (a RoPE cache old checkpoints saved) and
# GGUF `rope_freqs.weight` (Llama 3.1 RoPE scaling factors, which mlx_lm derives from `rope_scaling`).
LLAMA = Architecture(
    model_types=("llama", "mistral", "ministral3"),
    gguf_arch="llama",
    rules=(
        EMBEDDING,
        ATTENTION_NORM,
        *attention(bias=Need.OPTIONAL),  # attention_bias=True checkpoints
        rule(
            "layers.{n}.attention.output.bias", "model.layers.{n}.self_attn.o_proj.bias", "blk.{n}.attn_output.bias",
            need=Need.OPTIONAL,
        ),
        FFN_NORM,
        *ffn(bias=Need.OPTIONAL),  # mlp_bias=True checkpoints
        *OUTPUT,
    ),
    adapters=(QK_PERMUTATION,),
)

ARCHITECTURES = [LLAMA]
