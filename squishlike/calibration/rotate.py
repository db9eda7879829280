"""Rotations fused into the weights (QuaRot's and SpinQuant's R1 and R2): an exact, function-preserving rewrite of
the source model into one of the same architecture whose weights have fewer outlier channels, written as a float32
MLX directory that compress then quantizes like any source (docs/design.md §7.6).

- R1, the residual stream: x -> x Q for one random orthogonal Q (d x d, `random_hadamard`). Each norm whose output
  linears read has its weight (w + offset: Gemma's 1 + w) folded into those readers' input columns and is left at
  identity, so that it commutes with Q (an RMS norm without weight does: |x Q| = |x|); then the embedding's rows
  E -> E Q, every reader W -> W diag(g) Q, every writer (a linear that reads no norm and writes d rows) W -> Q^T W
  and its bias b -> b Q, and the head absorbs the final norm: H -> H diag(g) Q. A tied head cannot stay the
  embedding (E Q is not E diag(g) Q): the rotated model gets its own lm_head (`tie_word_embeddings: false`).
- R2, each head's values (alone with `rotate="heads"`, which keeps a tied head tied): v's rows of every kv head -> R^T v, o's columns of every query head -> o R, for one
  random orthogonal R (head_dim x head_dim): attention mixes whole value vectors, so R passes through it.

Nothing is assumed from names: the norms and their readers are found by probing the layer (linears.probe), the
v -> o pair by trying each linear pair whose shapes fit, and every layer's rewrite is verified by running it in
float32 on calibration hidden states: the rotated layer on x Q must give the original's output times Q within
awq.FOLD_TOLERANCE. Where that fails (a norm on a writer's output, Gemma's sandwich norms; LayerNorm's mean
subtraction), R1 is not applied to the model at all (one Q runs through every layer) and the record says why; R2
is kept or skipped layer by layer.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..compress_options import CompressOptions, runtime_dtype
from ..config import load_config
from ..errors import UnsupportedArchitectureError
from ..model import model_tokenizer, new_model, parameter_shapes
from ..provider import WeightProvider
from .awq import FOLD_TOLERANCE, norm_like, outside_norms, relative_change, weight_offset
from .blocks import BlockRunner, module_at
from .linears import probe, vocabulary
from .stats import calibration_windows

ROTATION_SEED = 0  # the rotation is random but fixed: a resumed compress rewrites the same weights
VERIFY_TOKENS = 64  # calibration tokens each layer's rewrite is verified on
INDEX = "model.safetensors.index.json"


@contextmanager
def rotated(provider: WeightProvider, out: Path, opts: CompressOptions):
    """(the provider compress reads, the options it writes with) for a compress into `out` with `opts.rotate`: the
    source rotated into a float32 copy beside `out` that lives as long as this context (a killed run's is a stale
    temp the next run sweeps; the rotation is seeded, so a resumed run makes the same weights), the runtime dtype
    still the source's and the rotation's record in the manifest."""
    directory = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-rotated-", dir=out.parent))
    try:
        record = rotate_source(provider, directory, opts.rotate)
        print(f"compress: rotated ({_summary(record)})", file=sys.stderr)
        with WeightProvider.open(directory) as source:
            yield source, replace(opts, dtype=opts.dtype or runtime_dtype(provider),
                                  extra_manifest={**opts.extra_manifest, "rotation": record})
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _summary(record: dict) -> str:
    residual = record["residual"]
    first = (f"residual stream {residual['matrix']}" if residual["applied"]
             else f"residual stream not rotated: {residual['why_not']}")
    return f"{first}; the values of {record['heads']['layers']} layers' heads"


def random_hadamard(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random orthogonal n x n matrix (float64) that spreads every channel over all n: random signs times a
    normalized Sylvester Hadamard of n's largest power-of-two factor, Kronecker a random orthogonal block (QR of a
    Gaussian) of the odd rest (SmolLM2's 576 = 64 x 9). Every entry is nonzero, so an outlier channel lands on all."""
    k = n & -n
    h = np.ones((1, 1))
    while h.shape[0] < k:
        h = np.block([[h, h], [h, -h]])
    h /= math.sqrt(k)
    m = n // k
    if m > 1:
        q, r = np.linalg.qr(rng.standard_normal((m, m)))
        h = np.kron(h, q * np.sign(np.diag(r)))
    return rng.choice((-1.0, 1.0), n)[:, None] * h


def rotate_source(provider: WeightProvider, directory: Path, method: str = "hadamard") -> dict:
    """Write `provider`'s model, rotated (`method`: "hadamard", R1 and R2; "heads", R2 alone), into `directory` (empty): its side files, a config.json (untied where the
    head had to be) and float32 safetensors under mlx_lm's names, one file per layer. Returns the manifest's record:
    what was rotated, what was not and why, and the source's parameter count (a size target's denominator: the
    untied head is extra bytes, not extra parameters)."""
    provider.write_side_files(directory)
    config = provider.dense_config()
    model = new_model(config, provider.reader.path)
    canonical = {provider.mlx_name(n): n for n in provider.names()}
    tokenizer = model_tokenizer(load_config(directory), directory, provider.reader.path)
    windows = calibration_windows(tokenizer, max_tokens=VERIFY_TOKENS)[:1]

    def weights(names: Iterable[str]):
        for n in names:
            yield n, provider.get(canonical[n])

    runner = BlockRunner(model, list(canonical), weights, windows)
    rng = np.random.default_rng(ROTATION_SEED)
    d = runner.hidden[0].shape[-1]
    q = random_hadamard(d, rng)
    heads, kv, head_dim = _heads(config, d)
    r = random_hadamard(head_dim, rng) if head_dim else None
    record = {"method": method, "seed": ROTATION_SEED, "verified_on_tokens": VERIFY_TOKENS,
              "parameters": sum(math.prod(s) for s in parameter_shapes(model).values())}
    head_name, why_not = ((None, "rotate=heads leaves the residual stream (and a tied head) as it is")
                          if method == "heads" else _outside_plan(runner, canonical, config, d))
    residual = why_not is None
    while True:
        files: dict[str, str] = {}
        heads_done, heads_skipped = 0, {}
        hidden = runner.hidden[0]
        for i in range(len(runner)):
            arrays, hidden, r1_failure, r2_found = _rotate_block(runner, i, hidden, q if residual else None,
                                                                 (r, heads, kv, head_dim) if r is not None else None)
            if r1_failure is not None:
                residual, why_not = False, r1_failure
                break
            if r2_found is None:
                heads_skipped[f"layer {i}"] = "no pair of linears whose per-head rotation leaves the layer exact"
            else:
                heads_done += 1
                record["heads_pair"] = r2_found
            _save(directory, f"model-layer-{i:05d}.safetensors", arrays, files)
        else:
            break
        for f in set(files.values()):
            (directory / f).unlink()
    outside = _rotate_outside(runner, canonical, q if residual else None, head_name, hidden)
    _save(directory, "model-outside.safetensors", outside, files)
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": files}, indent=1))
    if residual and head_name is not None and config.get("tie_word_embeddings", True):
        config["tie_word_embeddings"] = False
        record["untied_head"] = head_name
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    record["residual"] = {"applied": residual, **({"dimension": d, "matrix": _describe(d)} if residual else
                                                  {"why_not": why_not})}
    record["heads"] = {"layers": heads_done, **({"matrix": _describe(head_dim)} if heads_done else {}),
                       **({"skipped": heads_skipped} if heads_skipped else {})}
    return record


def _describe(n: int) -> str:
    k = n & -n
    return f"random signs x Hadamard {k}" + (f" kron random orthogonal {n // k}" if n // k > 1 else "")


def _heads(config: dict, d: int) -> tuple[int, int, int]:
    """(attention heads, kv heads, head dim) from the config; zeros where it does not say."""
    heads = config.get("num_attention_heads") or 0
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (d // heads if heads and d % heads == 0 else 0)
    return (heads, kv, head_dim) if heads and kv and heads % kv == 0 and head_dim else (0, 0, 0)


def _outside_plan(runner: BlockRunner, canonical: dict[str, str], config: dict, d: int) -> tuple[str | None,
                                                                                                  str | None]:
    """(the untied model's head weight name, when the head must be untied; why R1 cannot apply, or None)."""
    norms = outside_norms(runner)
    if len(norms) != 1:
        return None, f"{len(norms)} norms outside the layers, not one final norm the head reads"
    embedding, head = vocabulary(runner.model, canonical)
    if embedding is None or head is None:
        return None, "no single token embedding and output head"
    known = {f"{norms[0]}.weight", *(n for n, c in canonical.items() if c in (embedding, *head.members))}
    shapes = parameter_shapes(runner.model)
    for name in runner.outside_names:
        if name not in known and d in shapes.get(name, ()):
            return None, f"{name} is outside the layers on the residual stream: not known how to rotate it"
    if not isinstance(module_at(runner.model, head.module), nn.Embedding):
        return None, None
    untied = new_model({**config, "tie_word_embeddings": False})
    _, own = vocabulary(untied, {n: n for n in parameter_shapes(untied)})
    if own is None or not isinstance(module_at(untied, own.module), nn.Linear):
        return None, "the head is tied to the embedding and the model cannot untie it"
    return own.members[0], None


def _rotate_block(runner: BlockRunner, i: int, x: mx.array, q: np.ndarray | None, r2) -> tuple:
    """Block `i` rotated: (its weights by mlx name, float32; the original block's output on `x`, the next block's
    input; why R1 is not exact here or None; the v -> o pair rotated, or None)."""
    block = runner.load(i)
    prefix = runner.slots[i].prefix
    original = {prefix + n: np.array(a, dtype=np.float64) for n, a in tree_flatten(block.parameters())}
    y = runner.forward(i, 0, x)
    runner.evaluate(i, [y])
    rotated = dict(original)
    if q is not None:
        rotated, problem = _rotate_residual(runner, i, original, q)
        if problem is None:
            problem = _mismatch(runner, i, rotated, x, y, q)
        if problem is not None:
            runner.release(i)
            return {}, y, f"layer {i}: {problem}", None
    found = None
    if r2 is not None:
        for v, o in _head_pairs(runner, i, r2):
            trial = _rotate_heads(rotated, v, o, r2)
            if _mismatch(runner, i, trial, x, y, q) is None:
                rotated, found = trial, f"{v.removeprefix(prefix)} -> {o.removeprefix(prefix)}"
                break
    runner.release(i)
    return {n: a.astype(np.float32) for n, a in rotated.items()}, y, None, found


def _rotate_residual(runner: BlockRunner, i: int, params: dict, q: np.ndarray) -> tuple[dict, str | None]:
    """Block `i`'s weights (`params`) with the residual stream rotated by `q`, norms folded into their readers."""
    prefix = runner.slots[i].prefix
    d = q.shape[0]
    norms = [prefix + p for p, m in runner.block(i).named_modules() if norm_like(m)]
    linears = [prefix + p for p, m in runner.block(i).named_modules() if type(m) is nn.Linear]
    probes, _ = probe(runner, i, [*norms, *linears])
    made_by = {id(probes[n]._squish_outputs[0]): n for n in norms if len(probes[n]._squish_outputs) == 1}
    out = dict(params)
    readers = set()
    for path in linears:
        p = probes[path]
        if len(p._squish_inputs) != 1 or (norm := made_by.get(id(p._squish_inputs[0]))) is None:
            continue
        if f"{norm}.bias" in params:
            return out, f"{norm} adds a bias its readers cannot take"
        offset = weight_offset(module_at(runner.model, norm))
        g = params[f"{norm}.weight"] + offset
        out[f"{path}.weight"] = (params[f"{path}.weight"] * g[None, :]) @ q
        out[f"{norm}.weight"] = np.full_like(g, 1.0 - offset)
        readers.add(path)
    for path in linears:
        if path not in readers and params[f"{path}.weight"].shape[0] == d:
            out[f"{path}.weight"] = q.T @ params[f"{path}.weight"]
            if f"{path}.bias" in params:
                out[f"{path}.bias"] = params[f"{path}.bias"] @ q
    return out, None


def _head_pairs(runner: BlockRunner, i: int, r2) -> list[tuple[str, str]]:
    """(producer, reader) linears of block `i` whose shapes fit a per-head rotation: the producer writes a row per
    kv head's channel, the reader reads a column per query head's, in the same module (attention's v and o)."""
    _, heads, kv, head_dim = r2
    prefix = runner.slots[i].prefix
    linears = {prefix + p: m for p, m in runner.block(i).named_modules() if type(m) is nn.Linear}
    return [(v, o) for v, mv in linears.items() for o, mo in linears.items()
            if v != o and v.rpartition(".")[0] == o.rpartition(".")[0]
            and mv.weight.shape[0] == kv * head_dim and mo.weight.shape[1] == heads * head_dim]


def _rotate_heads(params: dict, v: str, o: str, r2) -> dict:
    r, heads, kv, head_dim = r2
    out = dict(params)
    w = params[f"{v}.weight"]
    out[f"{v}.weight"] = np.einsum("ji,hjc->hic", r, w.reshape(kv, head_dim, -1)).reshape(w.shape)
    if f"{v}.bias" in params:
        out[f"{v}.bias"] = (params[f"{v}.bias"].reshape(kv, head_dim) @ r).reshape(-1)
    w = params[f"{o}.weight"]
    out[f"{o}.weight"] = (w.reshape(w.shape[0], heads, head_dim) @ r).reshape(w.shape)
    return out


def _mismatch(runner: BlockRunner, i: int, params: dict, x: mx.array, y: mx.array, q: np.ndarray | None) -> str | None:
    """None when block `i` with `params` maps x Q to y Q (x to y without `q`) within FOLD_TOLERANCE; else how far off.
    The block's weights are the original's again afterwards."""
    saved = dict(tree_flatten(runner.block(i).parameters()))
    qm = None if q is None else mx.array(q.astype(np.float32))
    runner.set_weights(i, [(n, mx.array(a.astype(np.float32))) for n, a in params.items()])
    try:
        after = runner.forward(i, 0, x if qm is None else x @ qm)
        expected = y if qm is None else y @ qm
        runner.evaluate(i, [after, expected])
    except (ValueError, TypeError) as e:
        return f"the rewritten layer does not run ({e})"
    finally:
        runner.block(i).load_weights(list(saved.items()))
    change = relative_change(after, expected)
    return None if change <= FOLD_TOLERANCE else (f"the rotated layer's output moves by {change:.2g} of its largest "
                                                  "(a norm it does not commute with: on a writer's output, or one "
                                                  "that centres)")


def _rotate_outside(runner: BlockRunner, canonical: dict[str, str], q: np.ndarray | None, head_name: str | None,
                    final: mx.array) -> dict[str, np.ndarray]:
    """The tensors outside the blocks, rotated by `q` (unchanged without): the embedding's rows, the head with the
    final norm folded in (into `head_name`, a new untied head, when not None) and the final norm at identity."""
    names = runner.outside_names
    arrays = {n: np.array(a.astype(mx.float32), dtype=np.float64) for n, a in runner.weights(names)}
    if q is None:
        return {n: a.astype(np.float32) for n, a in arrays.items()}
    embedding, head = vocabulary(runner.model, canonical)
    mlx_of = {c: m for m, c in canonical.items()}
    norm = outside_norms(runner)[0]
    offset = weight_offset(module_at(runner.model, norm))
    g = arrays[f"{norm}.weight"] + offset
    e, h = mlx_of[embedding], mlx_of[head.members[0]]
    head_weight = (arrays[h] * g[None, :]) @ q
    _check_tail(module_at(runner.model, norm), final, arrays[h], head_weight, q, offset)
    arrays[e] = arrays[e] @ q
    arrays[head_name or h] = head_weight
    arrays[f"{norm}.weight"] = np.full_like(g, 1.0 - offset)
    return {n: a.astype(np.float32) for n, a in arrays.items()}


def _check_tail(norm: nn.Module, final: mx.array, head: np.ndarray, rotated_head: np.ndarray, q: np.ndarray,
                offset: float) -> None:
    """Raise UnsupportedArchitectureError unless the final norm at identity and the rotated head give the
    original logits on the last layer's output rotated (`final` Q)."""
    saved = norm.weight
    before = norm(final) @ mx.array(head.T.astype(np.float32))
    norm.weight = mx.full(saved.shape, 1.0 - offset, dtype=saved.dtype)
    try:
        after = norm(final @ mx.array(q.astype(np.float32))) @ mx.array(rotated_head.T.astype(np.float32))
    finally:
        norm.weight = saved
    change = relative_change(after, before)
    if change > FOLD_TOLERANCE:
        raise UnsupportedArchitectureError(f"the rotated head's logits move by {change:.2g} of their largest: the "
                                           "final norm does not commute with the rotation")


def _save(directory: Path, file: str, arrays: dict[str, np.ndarray], files: dict[str, str]) -> None:
    mx.save_safetensors(str(directory / file), {n: mx.array(a) for n, a in arrays.items()})
    files.update({n: file for n in arrays})
