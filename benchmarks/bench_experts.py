"""Experts streamed from the store (`squishlike.load(path, max_memory=...)`, squishlike/load/) against the resident
load of the same INT4 store: greedy decode tokens/s, the same tokens asserted, peak RSS, the expert cache's hit rate
and bytes read per token, at expert caches of 25 %, 50 % and 100 % of the experts' bytes.

Model: the shapes of Qwen3-30B-A3B (or Qwen1.5-MoE-A2.7B, `--shape qwen1.5-moe`), random weights: an MLX 4-bit
directory of random codes, per-group scales that keep each linear's output at its input's scale (so activations
neither vanish nor blow up: embeddings of unit scale, norms at 1), routers dense; then `squishlike.compress` to an
INT4 store (a repack of the codes). `--layers`, `--experts` and `--vocab` shrink it (the per-expert shapes stay
the real ones); the store is built once under --workdir and reused, and a store already at --workdir/store is taken
as it is (the full-size run's: `squishlike compress` of bench_compress.py's `qwen-moe` bf16 source, where the disk
holds one store but not a source and a store of this model).

Each configuration runs in its own process, one after the other: load, a 16-token prompt, `--tokens` greedy
tokens (mlx_lm's generate_step); decode tokens/s counts the tokens after the first. Peak RSS is the process's
VmHWM, and the whole process's by `/usr/bin/time -v` where there is one. `--max-memory` adds a run of
`squishlike.load(store, max_memory=...)` as a user calls it; `--bf16-baseline` the resident load as before the CPU
path for experts (MLX's bf16 gather_qmm, MLX's float32 quantized_matmul), `--mlx-baseline` with MLX's float32
products for both (the Rust kernel off). With `--cold` the store's files are dropped from the page cache (posix_fadvise) before each run;
otherwise they are read once first, so every run finds them cached.

    python -m benchmarks.bench_experts --workdir DIR [--shape qwen3-moe] [--layers 48] [--experts 128]
        [--vocab 151936] [--tokens 128] [--budgets 25,50,100] [--budget-tokens N] [--max-memory 3GB] [--cold]
        [--bf16-baseline] [--mlx-baseline] [--no-readahead] [--json FILE]

The full Qwen3-30B-A3B shape (the defaults) writes a 17 GB source and a 17 GB store under --workdir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

QWEN3_MOE = {  # Qwen3-30B-A3B's config.json
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
QWEN2_MOE = {  # Qwen1.5-MoE-A2.7B's config.json
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
SHAPES = {"qwen3-moe": QWEN3_MOE, "qwen1.5-moe": QWEN2_MOE}
GROUP = 64
PROMPT = list(range(100, 116))


def build_source(dest: Path, config: dict, seed: int = 0) -> Path:
    """An MLX 4-bit directory of `config`'s model with random codes (one safetensors file per layer)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from benchmarks.loadbench.models import _build_into, _built, _small_tokenizer
    from squishlike.model import new_model

    if _built(dest):
        return dest
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**32, 1 << 24, dtype=np.uint32)  # 64 MiB of random codes, sliced at random offsets
    shapes = dict(tree_flatten(new_model(config).parameters()))  # unevaluated: shapes only
    with _build_into(dest) as tmp:
        tmp.mkdir(parents=True)
        files: dict[str, dict[str, mx.array]] = {}
        for name, array in shapes.items():
            block = name.split(".")[2] if name.startswith("model.layers.") else "rest"
            files.setdefault(block, {}).update(_tensor(name, tuple(array.shape), config, rng, pool))
        index = {}
        for block, tensors in files.items():
            file = f"model-{block}.safetensors"
            mx.save_safetensors(str(tmp / file), tensors, metadata={"format": "mlx"})
            index.update(dict.fromkeys(tensors, file))
            tensors.clear()
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        quantization = {"group_size": GROUP, "bits": 4, "mode": "affine"}
        (tmp / "config.json").write_text(json.dumps({**config, "quantization": quantization,
                                                     "quantization_config": quantization}, indent=1))
        _small_tokenizer(tmp)
    return dest


def _tensor(name: str, shape: tuple[int, ...], config: dict, rng, pool) -> dict:
    """One parameter as the MLX 4-bit directory holds it: norms at 1; routers dense, N(0, 1/in); every other
    matrix as random 4-bit codes whose groups' scales make its output about as large as its input (embeddings:
    values of about unit size), each group's scale drawn around that, and biases centring the codes."""
    import mlx.core as mx

    if len(shape) == 1:
        return {name: mx.ones(shape, mx.bfloat16)}
    *lead, cols = shape
    if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
        return {name: mx.array(rng.standard_normal(shape, np.float32) * cols ** -0.5).astype(mx.bfloat16)}
    words = math.prod(lead) * cols // 8
    start = int(rng.integers(0, len(pool)))
    codes = np.resize(np.roll(pool, -start), words).reshape(*lead, cols // 8)
    # uniform codes 0..15 have variance 255/12: scale s gives values of spread 4.6 s
    spread = 1.0 if "embed_tokens" in name else cols ** -0.5
    groups = (*lead, cols // GROUP)
    scales = (spread / math.sqrt(255 / 12)) * np.exp(0.25 * rng.standard_normal(groups, np.float32))
    prefix = name.removesuffix(".weight")
    return {f"{prefix}.weight": mx.array(codes), f"{prefix}.scales": mx.array(scales).astype(mx.bfloat16),
            f"{prefix}.biases": mx.array(-7.5 * scales).astype(mx.bfloat16)}


def build_store(workdir: Path, config: dict) -> Path:
    import squishlike

    store = workdir / "store"
    if (store / "manifest.json").is_file():
        return store
    source = build_source(workdir / "source", config)
    started = time.perf_counter()
    squishlike.compress(source, store, scheme="int4", dtype="bfloat16", group_size=GROUP, awq=False, gptq=False,
                        clip_search=False)
    print(f"compressed in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return store


def run_once(store: Path, share: float | None, tokens: int, bf16_experts: bool = False,
             readahead: bool = True, max_memory: int | None = None, kernel: bool = True) -> dict:
    """One configuration, in this process: the resident load (`share` None), experts streamed with a cache of
    `share` of their bytes, or (`max_memory`) `squishlike.load(store, max_memory=...)` as a user calls it.
    `bf16_experts`: the resident load as before the CPU path for experts (the baseline of issue 42's item 4): its
    expert stacks on MLX's bf16 gather_qmm, its dense layers on MLX's float32 quantized_matmul. `readahead`: whether
    the cache announces the sibling stacks' experts to the kernel (ExpertCache.readahead). `kernel`: whether the
    quantized layers take the Rust kernel (cpu_layers.KERNEL), or MLX's float32 quantized_matmul and gather_qmm."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import squishlike
    from squishlike import cpu_layers
    from squishlike.load.budget import expert_stacks, streamed_budget
    from squishlike.load.experts import ExpertCache, expert_cache
    from squishlike.load.streamed import load_streamed
    from squishlike.npydir import NpyDir

    ExpertCache.readahead = readahead
    cpu_layers.KERNEL = kernel and not bf16_experts
    started = time.perf_counter()
    if max_memory is not None:
        model, _ = squishlike.load(store, max_memory=max_memory)
        budget = None
    elif share is None:
        model, _ = squishlike.load(store)
        budget = None
        if bf16_experts:
            from mlx_lm.models.switch_layers import QuantizedSwitchLinear

            for _, module in model.named_modules():
                if isinstance(module, QuantizedSwitchLinear):
                    module.__class__ = QuantizedSwitchLinear
    else:
        opened = NpyDir(store)
        stacks = expert_stacks(opened, opened.config())
        experts = streamed_budget(opened, stacks, 0).experts
        budget = streamed_budget(opened, stacks, int(share * experts))
        model, _, _ = load_streamed(opened, budget, verify=False, tokenizer_config=None, model_config=None,
                                    trust_remote_code=False)
    load_s = time.perf_counter() - started
    generated, stamps = [], []
    started = time.perf_counter()
    for token, _ in generate_step(mx.array(PROMPT), model, max_tokens=tokens):
        generated.append(int(token))
        stamps.append(time.perf_counter())
    cache = expert_cache(model)
    decode_s = stamps[-1] - stamps[0]
    return {
        "share": share, "load_s": load_s, "prefill_s": stamps[0] - started, "tokens": generated,
        "decode_tps": (len(generated) - 1) / decode_s if decode_s else 0.0, "peak_rss": _vm_hwm(),
        "max_memory": budget.max_memory if budget else max_memory, "cache": cache.capacity if cache else None,
        "hit_rate": cache.stats.hit_rate if cache else None,
        "read_per_token": cache.stats.bytes_read / len(generated) if cache else None,
    }


def _vm_hwm() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_experts"))
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-moe")
    parser.add_argument("--layers", type=int, help="layers (default: the model's)")
    parser.add_argument("--experts", type=int, help="experts per layer (default: the model's)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the model's)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--budgets", default="25,50,100", help="expert caches, in %% of the experts' bytes")
    parser.add_argument("--budget-tokens", type=int,
                        help="tokens of the --budgets runs (default --tokens): fewer, where a long run is slow")
    parser.add_argument("--max-memory", help="also run squishlike.load(store, max_memory=...), e.g. 3GB")
    parser.add_argument("--cold", action="store_true", help="drop the store from the page cache before each run")
    parser.add_argument("--bf16-baseline", action="store_true",
                        help="also run the resident load as before the CPU path for experts (MLX's bf16 gather_qmm)")
    parser.add_argument("--mlx-baseline", action="store_true",
                        help="also run the resident load on MLX's float32 gather_qmm and quantized_matmul")
    parser.add_argument("--no-readahead", action="store_true",
                        help="streamed runs without the sibling stacks' readahead (to measure it)")
    parser.add_argument("--json", type=Path, help="write every run's figures (and its tokens) here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        kind, _, value = args.child.partition(":")
        share = float(value) if kind == "share" else None
        max_memory = int(value) if kind == "max" else None
        print(json.dumps(run_once(args.workdir / "store", share, args.tokens, kind == "resident-bf16",
                                  not args.no_readahead, max_memory, kind != "resident-mlx")))
        return
    config = dict(SHAPES[args.shape])
    for key, value in (("num_hidden_layers", args.layers), ("num_experts", args.experts), ("vocab_size", args.vocab)):
        if value is not None:
            config[key] = value
    workdir = args.workdir
    store = build_store(workdir, config)
    from benchmarks.loadbench.pagecache import evict
    from squishlike.load.budget import parse_size

    files = sorted((store / "tensors").glob("*.safetensors"))
    store_gb = sum(f.stat().st_size for f in files) / 1e9
    header = (f"{args.shape}: {config['num_hidden_layers']} layers, {config['num_experts']} experts (top "
              f"{config['num_experts_per_tok']}), vocab {config['vocab_size']}; INT4 store {store_gb:.2f} GB; "
              f"{args.tokens} tokens; page cache: {'dropped' if args.cold else 'warm'}; readahead "
              f"{'off' if args.no_readahead else 'on'}")
    print(header)
    children = ["resident", *(f"share:{int(b) / 100}" for b in args.budgets.split(",") if b)]
    if args.max_memory:
        children.append(f"max:{parse_size(args.max_memory)}")
    children += ["resident-bf16"] * args.bf16_baseline + ["resident-mlx"] * args.mlx_baseline
    results = []
    for child in children:
        if args.cold:
            evict(files)
        else:
            for f in files:
                with open(f, "rb") as handle:
                    while handle.read(64 << 20):
                        pass
        tokens = args.budget_tokens if child.startswith("share:") and args.budget_tokens else args.tokens
        results.append({**_run_child(workdir, child, tokens, args.no_readahead), "child": child})
        if args.json:  # after every run: a long run's figures survive a later one's failure
            args.json.write_text(json.dumps({"header": header, "runs": results}, indent=1))
    _print_table(results)


def _run_child(workdir: Path, child: str, tokens: int, no_readahead: bool) -> dict:
    """One configuration in a fresh process, under `/usr/bin/time -v` where there is one (the whole process's
    peak RSS, as the issue measures it, beside the child's own VmHWM)."""
    command = [sys.executable, "-m", "benchmarks.bench_experts", "--workdir", str(workdir), "--tokens", str(tokens),
               "--child", child, *["--no-readahead"] * no_readahead]
    timed = Path("/usr/bin/time").is_file()
    run = subprocess.run(["/usr/bin/time", "-v", *command] if timed else command, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"{child} failed:\n{run.stderr}")
    result = json.loads(run.stdout.splitlines()[-1])
    if timed:
        line = next(l for l in run.stderr.splitlines() if "Maximum resident set size" in l)
        result["time_v_peak_rss"] = int(line.split(":")[1]) * 1024
    return result


def _print_table(results: list[dict]) -> None:
    base = results[0]
    print(f"{'load':<22}{'max_memory':>12}{'peak RSS':>10}{'time -v':>9}{'load s':>8}{'prefill s':>10}"
          f"{'decode tok/s':>14}{'vs resident':>12}{'hit rate':>10}{'MB read/token':>15}")
    for r in results:
        kind, _, value = r["child"].partition(":")
        name = {"resident": "resident", "resident-bf16": "resident, before (bf16)",
                "resident-mlx": "resident, MLX float32", "share": f"experts {100 * float(value or 0):.0f} %",
                "max": "load(max_memory)"}[kind]
        if kind in ("resident-bf16", "resident-mlx"):  # another accumulation: the tokens may part on a random model
            same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
            print(f"({name}: {same} of {len(base['tokens'])} tokens as the Rust kernel's)", file=sys.stderr)
        else:
            assert r["tokens"] == base["tokens"][:len(r["tokens"])], f"{name}: tokens differ from the resident load's"
        budget = f"{r['max_memory'] / 1e9:.2f} GB" if r["max_memory"] else "-"
        hit = f"{100 * r['hit_rate']:.1f} %" if r["hit_rate"] is not None else "-"
        read = f"{r['read_per_token'] / 1e6:.1f}" if r["read_per_token"] is not None else "-"
        timed = f"{r['time_v_peak_rss'] / 1e9:.2f}GB" if "time_v_peak_rss" in r else "-"
        print(f"{name:<22}{budget:>12}{r['peak_rss'] / 1e9:>8.2f}GB{timed:>9}{r['load_s']:>8.1f}"
              f"{r['prefill_s']:>10.2f}{r['decode_tps']:>14.2f}{r['decode_tps'] / base['decode_tps']:>11.2f}x"
              f"{hit:>10}{read:>15}")
    print("same tokens as the resident load (as many as each run generated): yes (every streamed run)")


if __name__ == "__main__":
    main()
