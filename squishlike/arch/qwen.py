"""Qwen2 and Qwen3: Llama's table plus Q/K/V biases (Qwen2) or per-head Q/K norms (Qwen3).

llama.cpp runs both with NEOX-style RoPE, so their GGUFs keep HF's row order: no Q/K permutation.
"""

from __future__ import annotations

from . import Architecture, Need
from .llama import ATTENTION_NORM, EMBEDDING, FFN_NORM, OUTPUT, QK_NORMS, attention, ffn

QWEN2 = Architecture(
    model_types=("qwen2",),
    gguf_arch="qwen2",
    rules=(EMBEDDING, ATTENTION_NORM, *attention(bias=Need.ALWAYS), FFN_NORM, *ffn(bias=Need.OPTIONAL), *OUTPUT),
)

QWEN3 = Architecture(
    model_types=("qwen3",),
    gguf_arch="qwen3",
    rules=(
        EMBEDDING,
        ATTENTION_NORM,
        *attention(bias=Need.OPTIONAL),
        *QK_NORMS,
        FFN_NORM,
        *ffn(bias=Need.OPTIONAL),
        *OUTPUT,
    ),
)

ARCHITECTURES = [QWEN2, QWEN3]
