"""End-to-end distillation of a written store's grid (`compress --distill-steps`, docs/design.md §7.7).

mlx_lm's DWQ, from the store's own codes: the unpublished store is read as MLX quantized layers at its own widths
(the int4 tier straight from its packs: nothing is written), its codes frozen, and every group's scale and offset
of a width below 8 bits trained by mlx_lm's `dwq_quantize` (Adam on the temperature-2 KL to the float32 source's
logits) on the calibration text in samples of DISTILL_SAMPLE_TOKENS tokens, the last one held out, and on samples
the float model writes itself from their first tokens (as many as the steps reach, no download; docs/design.md
§7.7 measures each choice). The teacher's logits are computed again each step, not cached, so the text can grow
with the steps in bounded memory. The student runs in float32 with
each quantized layer a dense product of its dequantized weights (differentiable in its scales and offsets on every
device). The trained grid is rounded to the store's dtype and written back into the store's packs, so every tier
and `export --to mlx` give it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optimizers
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.quant.dwq import dwq_quantize
from mlx_lm.tuner.losses import kl_div_loss

from ..compress_options import DISTILL_SAMPLE_TOKENS, CompressOptions
from ..config import load_config
from ..dtypes import MX_DTYPES, to_numpy
from ..exporter import names_as, read_as
from ..model import build_model, model_tokenizer
from ..npydir import NpyDir, NpyDirWriter
from ..provider import WeightProvider
from ..tiers.base import mlx_names
from ..tiers.quantized import Int4Tier
from .stats import calibration_windows, log

SEED = 0  # the order of the samples and the sampled text: a store is the same each time it is compressed
CALIBRATION_PASSES = 2  # each calibration sample is trained on twice and each written one once: the recipe measured
# in docs/design.md §7.7 (SmolLM2's 2,311 calibration tokens give 8 samples, the ninth held out: 48 steps, 32 written)
PROMPT_TOKENS = 8  # each sampled sample starts from this many tokens of a calibration sample
SAMPLING_BATCH = 32  # samples written at once (SmolLM2's KV cache for 32 x 256 tokens: 0.4 GB)


def _dense(layer: nn.Module) -> mx.array:
    return mx.dequantize(layer["weight"], layer["scales"], layer["biases"], group_size=layer.group_size,
                         bits=layer.bits)


class _DenseLinear(nn.QuantizedLinear):
    """A quantized linear computed as the product with its dequantized weight: the same function and gradients,
    where mlx[cpu]'s quantized matmul is minutes for what float32 BLAS does in seconds."""

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ _dense(self).T
        return y + self["bias"] if "bias" in self else y


class _DenseEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:  # a tied head
        return x @ _dense(self).T


_DENSE = {nn.QuantizedLinear: _DenseLinear, nn.QuantizedEmbedding: _DenseEmbedding}


def dense_products(model: nn.Module) -> list[nn.Module]:
    """Compute `model`'s quantized linears and embeddings as dense products of their dequantized weights (in place,
    their parameters kept); returns those layers, whose `__class__.__base__` is their own class again."""
    layers = [module for _, module in model.named_modules() if type(module) in _DENSE]
    for module in layers:
        module.__class__ = _DENSE[type(module)]
    return layers


def teacher_logits(teacher: nn.Module) -> Callable[..., mx.array]:
    """dwq_quantize's target function: the teacher's logits for a batch, computed when asked (a forward pass a step,
    where caching them held 0.2 GB per sample of SmolLM2's vocabulary)."""

    def target(batch: mx.array, *_, **__) -> mx.array:
        return mx.stop_gradient(teacher(batch))

    return target


def written_samples(steps: int, calibration_samples: int) -> int:
    """How many samples the float model writes for `steps` steps: those the calibration samples' passes leave."""
    return max(0, steps - CALIBRATION_PASSES * calibration_samples)


def sampled_text(teacher: nn.Module, starts: list[list[int]], count: int) -> list[list[int]]:
    """`count` samples of DISTILL_SAMPLE_TOKENS tokens the teacher writes itself (temperature 1, seeded), each
    continuing the first PROMPT_TOKENS tokens of a calibration sample in turn, SAMPLING_BATCH at a time with a KV
    cache: data-free distillation's text (LLM-QAT), on which the teacher's own logits are the target, so more
    training text without a download."""
    written: list[list[int]] = []
    for first in range(0, count, SAMPLING_BATCH):
        batch = range(first, min(count, first + SAMPLING_BATCH))
        prompts = mx.array([starts[i % len(starts)][:PROMPT_TOKENS] for i in batch])
        cache = make_prompt_cache(teacher)
        logits = teacher(prompts, cache=cache)[:, -1]
        tokens, key = [prompts], mx.random.key(SEED + first // SAMPLING_BATCH)
        for _ in range(DISTILL_SAMPLE_TOKENS - PROMPT_TOKENS):
            key, sub = mx.random.split(key)
            tokens.append(mx.random.categorical(logits, key=sub)[:, None])
            logits = teacher(tokens[-1], cache=cache)[:, -1]
            mx.eval(logits)
        written += mx.concatenate(tokens, axis=1).tolist()
    return written


def distill_store(writer: NpyDirWriter, origin: WeightProvider, opts: CompressOptions) -> dict:
    """Train the scales and offsets of the store `writer` has written (manifest included, not published) against
    the float32 model `origin` reads, and write them back (NpyDirWriter.rewrite_parts); returns the manifest's
    `distill` record."""
    store = NpyDir(writer.path)
    loaded = Int4Tier().from_store(store)  # the store's tensors as mlx_lm's parameters, each layer at its width
    student = build_model(loaded.config, loaded.weights)
    student.set_dtype(mx.float32)
    dense_products(student)
    student.freeze()
    teacher = build_model(origin.dense_config(), {name: read_as(origin, "mlx", canonical, "float32")
                                                  for name, canonical in names_as(origin, "mlx").items()})
    tokenizer = model_tokenizer(load_config(writer.path), writer.path, writer.path)
    tokens = [t for window in calibration_windows(tokenizer, max_tokens=opts.calibration_max_tokens)
              for t in window.tokens]
    rows = np.array(tokens[: len(tokens) // DISTILL_SAMPLE_TOKENS * DISTILL_SAMPLE_TOKENS]).reshape(
        -1, DISTILL_SAMPLE_TOKENS)
    held, calibration = rows[-1:], [row.tolist() for row in rows[:-1]]
    sampled = written_samples(opts.distill_steps, len(calibration))
    train = [(row, 0) for row in calibration + sampled_text(teacher, calibration, sampled)]
    target = teacher_logits(teacher)

    def held_out_kl() -> float:
        """Temperature-1 KL(float || store) per position on the held-out sample."""
        x = mx.array(held[:, :-1])
        return kl_div_loss(student(x), target(x)).mean().item()

    before = held_out_kl()
    started = time.perf_counter()
    log(f"distilling the scales and offsets: {opts.distill_steps} steps on {len(calibration)} samples of "
        f"{DISTILL_SAMPLE_TOKENS} tokens of calibration text and {sampled} the float model wrote, held-out KL "
        f"{before:.4f}")
    data = (train * -(-opts.distill_steps // len(train)))[: opts.distill_steps]
    adam = optimizers.Adam(learning_rate=opts.distill_rate, bias_correction=True)
    with contextlib.redirect_stdout(sys.stderr):  # its reports are progress: stdout holds compress's result
        dwq_quantize(student, target, adam, data, train[:1], batch_size=1, max_seq_length=DISTILL_SAMPLE_TOKENS + 1,
                     seed=SEED, dtype=mx.float32)
    runtime = MX_DTYPES[store.runtime_dtype]
    student.eval()
    student.update(tree_map(lambda a: a.astype(runtime).astype(mx.float32), student.trainable_parameters()))
    after = held_out_kl()  # the grid as the store keeps it
    log(f"distilled: held-out KL {before:.4f} -> {after:.4f} in {time.perf_counter() - started:.0f} s")
    trained = dict(tree_flatten(student.trainable_parameters()))
    canonical = {mlx: name for name, mlx in mlx_names(store).items()}
    values: dict[str, dict[str, np.ndarray]] = {}
    for key, array in trained.items():
        layer, role = key.rsplit(".", 1)
        name = canonical[f"{layer}.weight"]
        suffix = store.entries[name].kind.suffixes[("weight", "scales", "biases").index(role)]
        dtype, shape = store.entries[name].part_spec(suffix)
        values.setdefault(name, {})[suffix] = to_numpy(array.astype(runtime))[0].view(dtype).reshape(shape)
    record = {"steps": opts.distill_steps, "rate": opts.distill_rate, "samples": len(calibration),
              "sampled": sampled, "tokens": DISTILL_SAMPLE_TOKENS, "seed": SEED, "tensors": len(values),
              "held_out_kl": {"before": before, "after": after},
              "method": "mlx_lm dwq_quantize: scales and offsets of widths below 8 bits, codes frozen, on the KL "
                        "to the float32 source's logits (temperature 2) on the calibration samples and those the "
                        "source wrote; held-out KL at temperature 1"}
    writer.rewrite_parts(values, {"distill": record})
    return record
