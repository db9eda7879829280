"""Where one family's KL comes from: each quantized tensor of squishlike's INT4 store and of mlx_lm's GPTQ, put alone
into the float source (every other tensor float), with the KL to the source that gives and the tensor's error
weighted by its calibration inputs, tr((W - Q) H (W - Q)^T) (H = X^T X on the calibration tokens, mlx_lm's GPTQ's
own Hessian); then the input embedding alone, rounded each way a store rounds it, and (`--embedding-paths`) which
path carries each rounding's error to the logits.

AWQ folds its scales into a neighbour (a norm, v's rows, up's rows), so one AWQ'd tensor alone is not the function
it stores: by default squishlike's store is compressed without AWQ (`--awq` keeps it; the swaps of AWQ'd tensors
then measure the fold's absence, not the rounding).

    python -m benchmarks.attribute_family llama [--seed 0] [--awq] [--embedding-only] [--embedding-paths]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def hessians(model, tokenizer) -> dict:
    """Each `nn.Linear`'s X^T X on the calibration tokens, as mlx_lm's GPTQ computes it (512-token rows)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.quant.gptq import Catcher

    from benchmarks.quality import sequences
    from squishlike.evaluation import load_text

    catchers = [(k, Catcher(m)) for k, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
                if type(m) is nn.Linear]
    model.update_modules(tree_unflatten(catchers))
    rows = sequences(tokenizer.encode(load_text("calibration")), 512)
    for s in range(0, len(rows), 8):
        model(rows[s:s + 8])
        mx.eval([c.H for _, c in catchers])
    model.update_modules(tree_unflatten([(k, c.module) for k, c in catchers]))
    return {f"{k}.weight": c.H for k, c in catchers}


def embedding_roundings(w, source: dict, model_type: str):
    """The input embedding `w` rounded as squishlike's store does (clip search, and without it) and as mlx_lm
    does (`mx.quantize`), 4 bits in groups of 64, bfloat16 scales: {label: dequantized float32}. Where the first
    layer is mlx_lm's usual attention (`model.layers.0`: `input_layernorm`, `self_attn.{q,k,v}_proj`), also a
    GPTQ of the embedding along its width on what reads it: the Hessian of those three linears' outputs with
    respect to the norm's input (their weights times the norm's weight, 1 + w for Gemma's), normalised to a mean
    diagonal of 1, plus the identity for the residual path that carries the row to every later layer (what
    compress does, calibration/lookup.py); and, where the model has its own head, the same with the head's W^T W
    (times the final norm's weight) in the identity's place: the residual stream's last reader."""
    import mlx.core as mx
    import numpy as np

    from squishlike import quant
    from squishlike.calibration.gptq import gptq, inverse_hessian_factor
    from squishlike.calibration.lookup import normalised
    from squishlike.calibration.quantizer import Quantizer

    values = np.array(w.astype(mx.bfloat16).astype(mx.float32))
    found = {}
    first = "model.layers.0."
    readers = [source.get(f"{first}self_attn.{x}_proj.weight") for x in "qkv"]
    if f"{first}input_layernorm.weight" in source and all(r is not None for r in readers):
        offset = 1.0 if model_type.startswith("gemma") else 0.0  # Gemma's norms scale by 1 + w
        norm = np.array(source[f"{first}input_layernorm.weight"]) + offset
        x = normalised(np.concatenate([np.array(r) for r in readers]) * norm[None, :])
        others = {"": np.eye(x.shape[1], dtype=np.float32)}
        if "lm_head.weight" in source and "model.norm.weight" in source:
            others[" and the head"] = normalised(np.array(source["lm_head.weight"])
                                                 * (np.array(source["model.norm.weight"]) + offset)[None, :])
        for label, rest in others.items():
            parts = gptq(values, "float32", Quantizer("int4", 64, "bfloat16", True),
                         inverse_hessian_factor(np.concatenate([x, rest])))
            found[f"GPTQ on the first layer's q, k, v{label}"] = mx.array(
                quant.dequantize("int4", *parts, group_size=64, scale_dtype="bfloat16", out_dtype="float32"))
    for clip in (True, False):
        parts = quant.quantize("int4", values, group_size=64, scale_dtype="bfloat16", clip_search=clip)
        found["clip search" if clip else "min-max"] = mx.array(
            quant.dequantize("int4", *parts, group_size=64, scale_dtype="bfloat16", out_dtype="float32"))
    found["mx.quantize"] = mx.dequantize(*mx.quantize(mx.array(values).astype(mx.bfloat16), group_size=64, bits=4),
                                         group_size=64, bits=4).astype(mx.float32)
    return found


def tensors_alone(src: Path, work: Path, model, tokenizer, source: dict, kl_with, awq: bool) -> None:
    """Print each quantized tensor's KL alone and its error, for squishlike's store and mlx_lm's GPTQ."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import squishlike
    from benchmarks.bench_families import mlx_lm_gptq
    from squishlike import evaluation as ev

    h = hessians(model, tokenizer)
    squishlike.compress(src, work / "squishlike", scheme="int4", **({} if awq else {"awq": False}))
    mlx_lm_gptq(src, work / "mlx_lm")
    stores = {name: dict(tree_flatten(ev.prepare_for_eval(squishlike.load(work / name, **kw)[0]).parameters()))
              for name, kw in (("squishlike", {"tier": "cold"}), ("mlx_lm", {}))}
    print(json.dumps({"awq": awq, **{f"{name} KL": kl_with(p) for name, p in stores.items()}}), flush=True)
    for name, w in source.items():
        if w.ndim < 2 or all(mx.array_equal(p.get(name, w), w) for p in stores.values()):
            continue
        row = {"tensor": name, "error": "H-weighted" if name in h else "squared"}
        for store, p in stores.items():
            d = p.get(name, w) - w
            row[f"{store} KL"] = kl_with({name: p.get(name, w)})
            row[f"{store} error"] = round(mx.sum((d @ h[name]) * d).item() if name in h else mx.sum(d * d).item(), 5)
        print(json.dumps(row), flush=True)


PATHS = ("everywhere", "first attention", "residual stream", "first MLP", "head alone")


def embedding_paths(model, windows, exact, rounded: dict) -> None:
    """Which path carries each rounding's error e = rounded - `exact` (of the looked-up rows) to the logits, for a
    first layer of mlx_lm's usual form (h = x + attention(norm(x)), then h + mlp(norm(h))) and the model's own head:
    KL to the source with e added everywhere (the store), only to the first layer's attention input (the residual
    carries the exact row), only to the residual stream (the attention reads the exact row; the first MLP, the
    later layers and the head see e), only to the first layer's MLP input, or only to the last layer's output
    (what the final norm and the head read)."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    inner = model.model

    def logprobs(window, error, where):
        tokens = mx.array(window.tokens[:-1])[None]
        x, err = inner.embed_tokens(tokens), error[tokens]
        mask, first = create_attention_mask(x, None), inner.layers[0]
        at = {p: (where in (p, "everywhere")) * err for p in ("first attention", "residual stream")}
        h = x + at["residual stream"] + first.self_attn(first.input_layernorm(x + at["first attention"]), mask, None)
        h = h + first.mlp(first.post_attention_layernorm(h + err * (where == "first MLP")))
        for layer in inner.layers[1:]:
            h = layer(h, mask, None)
        logits = model.lm_head(inner.norm(h + err * (where == "head alone")))[0, window.first_target - 1:]
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    zero = mx.zeros_like(exact)
    references = [logprobs(w, zero, "everywhere") for w in windows]
    for name, values in rounded.items():
        row = {"embedding's error only": name}
        for where in PATHS:
            kl = sum(mx.sum(mx.exp(r) * (r - logprobs(w, values - exact, where))).item()
                     for w, r in zip(windows, references))
            row[where] = round(kl / sum(r.shape[0] for r in references), 5)
        print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    from mlx.utils import tree_flatten

    from benchmarks.bench_families import build_source
    from squishlike import evaluation as ev
    from tests.support.tiny_models import make_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("type")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--awq", action="store_true", help="keep AWQ in squishlike's store (see above)")
    parser.add_argument("--embedding-only", action="store_true", help="only the input embedding's roundings")
    parser.add_argument("--embedding-paths", action="store_true",
                        help="and which path carries each rounding's error to the logits (embedding_paths)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = build_source(args.type, work / "source", make_tokenizer(work / "tokenizer"), args.seed)
        model, tokenizer = ev.load_float32(src)
        windows = ev.token_windows(tokenizer, ev.load_text("eval_prose"), max_tokens=1024)
        cache = ev.ReferenceCache(model, windows)
        source = dict(tree_flatten(model.parameters()))

        def kl_with(params: dict) -> float:
            model.load_weights(list(params.items()), strict=False)
            try:
                return round(ev.compare(model, cache, windows)["kl_mean"], 5)
            finally:
                model.load_weights(list(source.items()), strict=False)

        print(json.dumps({"type": args.type, "seed": args.seed}), flush=True)
        if not args.embedding_only:
            tensors_alone(src, work, model, tokenizer, source, kl_with, args.awq)
        embeddings = {p for p, m in model.named_modules() if type(m).__name__ == "Embedding"}
        embedding = next(n for n, w in source.items() if w.ndim == 2 and n.rpartition(".")[0] in embeddings)
        roundings = embedding_roundings(source[embedding], source, args.type)
        print(json.dumps({"embedding alone": embedding, **{k: kl_with({embedding: v}) for k, v in roundings.items()}}))
        if args.embedding_paths:
            embedding_paths(model, windows, source[embedding], roundings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
