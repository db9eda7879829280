#!/usr/bin/env python
"""Coverage-guided fuzzing (atheris, i.e. libFuzzer for Python) of every parser the provider and the npy-dir
reader use. A *crash* is any exception that is not one of squishlike's typed errors (squishlike.errors), a hang
(libFuzzer's -timeout), or a process death; libFuzzer stops at the first one and writes the input to crash-*.

    (cd tests && python -m fuzz.fuzz_parsers TARGET [libFuzzer flags])    e.g.  -runs=1000000  -max_total_time=600
    (cd tests && python -m fuzz.fuzz_parsers --list)

Targets (each writes the fuzzed bytes as one file of an otherwise valid model, then runs the real reader on it):

    safetensors   model.safetensors of an HF directory      -> HFReader: header, every tensor read and evaluated
    index         model.safetensors.index.json (2 shards)   -> HFReader
    config        config.json of an HF directory            -> WeightProvider (ModelConfig, arch table, rules)
    mlx_config    config.json of an MLX 4-bit directory     -> MLXReader: quantization table, every triple
    gguf          a .gguf file                              -> GGUFReader: header, metadata, tensors, tokenizer
    ollama        an Ollama manifest                        -> OllamaReader: layers, blobs, digests, config
    npy           one stored part (.npy) of an npy-dir      -> NpyDir.load_part / read_part_into / dequantize
    manifest      an npy-dir's manifest.json                -> NpyDir: validation, every part, tier sentinels
    sentinel      a tier sentinel (.squish_ready)           -> read_sentinel / Tier.ready (must never raise)

The seed corpus is the valid file plus the matching crafted files of tests/support/hostile_corpus.py; everything runs in
a scratch directory under /dev/shm (or /tmp). tests/fuzz/run_all.sh runs every target for a budget and prints figures.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import atheris  # noqa: E402

with atheris.instrument_imports(include=["squishlike", "gguf"]):
    import gguf  # noqa: F401
    import squishlike.arch  # noqa: F401
    import squishlike.config  # noqa: F401
    import squishlike.formats.gguf  # noqa: F401
    import squishlike.formats.mlx  # noqa: F401
    import squishlike.formats.npydir  # noqa: F401
    import squishlike.formats.ollama  # noqa: F401
    import squishlike.formats.safetensors  # noqa: F401
    import squishlike.provider  # noqa: F401
    import squishlike.io.sentinel  # noqa: F401
    import squishlike.tiers  # noqa: F401

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from squishlike.errors import SquishError  # noqa: E402

TARGETS = ("safetensors", "index", "config", "mlx_config", "gguf", "ollama", "npy", "manifest", "sentinel",
           "side_files", "tier_files")
SIDE_FILES = ("config.json", "generation_config.json")  # the npy-dir's side files its loads parse
TIER_FILES = ("squish_weights.safetensors", "squish_4bit/model.safetensors", "squish_4bit/config.json",
              "finalized/layers.0.attention.k.weight.npy", "finalized/token_embedding.weight.npy")


# ---------------------------------------------------------------------------------------------- the workspace


def scratch() -> Path:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="squishlike-fuzz-", dir=base))


class Workspace:
    """The valid models the fuzzed file is dropped into, and the seed corpus for one target."""

    def __init__(self, target: str, root: Path):
        import squishlike
        from support.crash_harness import CRASH_CONFIG
        from support.hostile_corpus import CASES, build_base, gguf_raw, st_raw
        from support.tiny_models import make_hf_model, make_tokenizer

        self.root = root
        self.seeds = root / "seeds"
        self.seeds.mkdir(parents=True)
        tok = make_tokenizer(root / "tokenizer")
        self.base = build_base(root / "base", tok)
        small = dict(CRASH_CONFIG, hidden_size=32, intermediate_size=64, vocab_size=64, num_attention_heads=2,
                     num_key_value_heads=1)
        self.hf = make_hf_model(root / "hf", small, tok)
        seeds: list[bytes] = []
        if target == "safetensors":
            self.file = self.hf / "model.safetensors"
            seeds.append(self.file.read_bytes())
            seeds.append(st_raw({"__metadata__": {"format": "pt"},
                                 "a": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]},
                                 "b": {"dtype": "I8", "shape": [3], "data_offsets": [16, 19]}}, bytes(19)))
        elif target == "index":
            self.dir = self._sharded()
            self.file = self.dir / "model.safetensors.index.json"
            seeds.append(self.file.read_bytes())
        elif target == "config":
            self.file = self.hf / "config.json"
            seeds.append(self.file.read_bytes())
        elif target == "mlx_config":
            from squishlike.exporter import export

            self.dir = Path(export(self.hf, "mlx", root / "mlx", quantize=True, q_bits=4, q_group_size=32))
            self.file = self.dir / "config.json"
            seeds.append(self.file.read_bytes())
        elif target == "gguf":
            self.file = root / "model.gguf"
            seeds += [gguf_raw(), self._real_gguf()]
        elif target == "ollama":
            self.file = self.base.ollama_manifest
            seeds.append(self.file.read_bytes())
        elif target == "npy":
            int8 = squishlike.compress(self.hf, root / "int8", scheme="int8", tiers=())
            int4 = squishlike.compress(self.hf, root / "int4", scheme="int4", group_size=32, tiers=())
            int3 = squishlike.compress(self.hf, root / "int3", scheme="int3", group_size=32, tiers=(), int3_gate=False)
            from squishlike.npydir import NpyDir

            self.parts = []  # (store, tensor name, suffix, path)
            for path in (int8, int4, int3):
                store = NpyDir(path)
                for name, entry in store.entries.items():
                    for suffix in entry.files:
                        if len(self.parts) < 255 and (entry.kind.quantized or len(self.parts) % 3 == 0):
                            self.parts.append((store, name, suffix, store.part_path(name, suffix)))
            for i, (_, _, _, p) in enumerate(self.parts[:12]):
                seeds.append(bytes([i]) + p.read_bytes())
            self.originals = {p: p.read_bytes() for *_, p in self.parts}
        elif target == "manifest":
            self.dir = shutil.copytree(self.base.built, root / "store")
            self.file = self.dir / "manifest.json"
            seeds.append(self.file.read_bytes())
        elif target in ("side_files", "tier_files"):
            from squishlike.npydir import NpyDir

            self.dir = shutil.copytree(self.base.built, root / "store")
            self.store = NpyDir(self.dir)
            self.files = SIDE_FILES if target == "side_files" else TIER_FILES
            self.originals = {rel: (self.dir / rel).read_bytes() if (self.dir / rel).exists() else None
                              for rel in self.files}
            seeds += [bytes([i]) + (raw or b"{}") for i, raw in enumerate(self.originals.values())]
        elif target == "sentinel":
            from squishlike.npydir import NpyDir

            self.dir = shutil.copytree(self.base.built, root / "store")
            self.store = NpyDir(self.dir)
            self.file = self.dir / ".squish_ready"
            seeds += [self.file.read_bytes(), (self.dir / "finalized" / ".ready").read_bytes()]
        else:
            raise SystemExit(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
        # the crafted files of the hostile corpus that are files of this kind
        corpus = root / "hostile"
        for case in CASES:
            d = corpus / case.name
            d.mkdir(parents=True)
            try:
                built = case.build(self.base, d)
            except Exception:  # noqa: BLE001 - a case needing another base; not a seed then
                continue
            seeds += self._hostile_seed(target, case.name, built)
        for i, s in enumerate(seeds):
            (self.seeds / f"seed-{i:03d}").write_bytes(s)
        shutil.rmtree(corpus, ignore_errors=True)

    def _hostile_seed(self, target: str, name: str, built: Path) -> list[bytes]:
        picks = {
            "safetensors": ("st-", "model.safetensors"),
            "index": ("st-index", "model.safetensors.index.json"),
            "config": ("config-", "config.json"),
            "manifest": ("manifest-", "manifest.json"),
            "gguf": ("gguf-", ""),
            "sentinel": ("sentinel-", ".squish_ready"),
            "ollama": ("ollama-", ""),
        }
        if target not in picks or not name.startswith(picks[target][0]):
            return []
        path = built if built.is_file() else built / picks[target][1]
        return [path.read_bytes()] if path.is_file() and path.stat().st_size < 1 << 20 else []

    def _sharded(self) -> Path:
        import json

        from safetensors.numpy import load_file, save_file

        d = self.root / "sharded"
        shutil.copytree(self.hf, d)
        tensors = load_file(str(d / "model.safetensors"))
        (d / "model.safetensors").unlink()
        names = sorted(tensors)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        for shard, part in shards.items():
            save_file({n: tensors[n] for n in part}, str(d / shard), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {n: s for s, part in shards.items() for n in part}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        return d

    def _real_gguf(self) -> bytes:
        """A small GGUF as llama.cpp writes one: metadata, a tokenizer, float and quantized tensors."""
        import gguf as g

        path = self.root / "seed.gguf"
        w = g.GGUFWriter(str(path), "llama")
        w.add_block_count(1)
        w.add_embedding_length(32)
        w.add_feed_forward_length(64)
        w.add_head_count(2)
        w.add_head_count_kv(1)
        w.add_context_length(64)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(8)])
        w.add_token_types([1] * 8)
        w.add_token_merges(["t 0", "t 1"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        rng = np.random.default_rng(0)
        w.add_tensor("token_embd.weight", rng.standard_normal((8, 32)).astype(np.float32))
        w.add_tensor("output_norm.weight", np.ones(32, np.float16))
        q8 = g.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), g.GGMLQuantizationType.Q8_0)
        w.add_tensor("blk.0.attn_q.weight", q8, raw_shape=q8.shape, raw_dtype=g.GGMLQuantizationType.Q8_0)
        q4 = g.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), g.GGMLQuantizationType.Q4_0)
        w.add_tensor("blk.0.attn_k.weight", q4, raw_shape=q4.shape, raw_dtype=g.GGMLQuantizationType.Q4_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


# ---------------------------------------------------------------------------------------------- the targets


def _eval(a) -> None:
    if a is not None:
        mx.eval(a)


def make_target(target: str, ws: Workspace):
    from squishlike.formats.gguf import GGUFReader
    from squishlike.formats.mlx import MLXReader
    from squishlike.npydir import NpyDir
    from squishlike.formats.ollama import OllamaReader
    from squishlike.formats.safetensors import HFReader
    from squishlike.provider import WeightProvider
    from squishlike.io.sentinel import read_sentinel
    from squishlike.tiers import ORDER, tier_status

    side = ws.root / "side"

    def run_reader(reader, limit: int = 64) -> None:
        with reader:
            infos = reader.tensors()
            for name in list(infos)[:limit]:
                _eval(reader.read(name))
                q = reader.read_quantized(name)
                if q is not None:
                    _eval(q.weight)
            reader.config()

    if target == "safetensors":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            run_reader(HFReader(ws.hf))
    elif target == "index":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            run_reader(HFReader(ws.dir))
    elif target == "config":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            with WeightProvider.open(ws.hf) as p:
                for name in p.names()[:4]:
                    _eval(p.get(name))
                p.config.to_dict()
    elif target == "mlx_config":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            run_reader(MLXReader(ws.dir))
    elif target == "gguf":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            reader = GGUFReader(ws.file)
            run_reader(reader, limit=16)
            if len(data) < 1 << 16:
                shutil.rmtree(side, ignore_errors=True)
                GGUFReader(ws.file).write_side_files(side)
    elif target == "ollama":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            run_reader(OllamaReader(ws.file))
            shutil.rmtree(side, ignore_errors=True)
            OllamaReader(ws.file).write_side_files(side)
    elif target == "npy":
        def body(data: bytes) -> None:
            if not data:
                return
            store, name, suffix, path = ws.parts[data[0] % len(ws.parts)]
            path.write_bytes(data[1:])
            try:
                store.load_part(name, suffix)
                store.dequantize(name)
                store.quantized(name)
                if hasattr(store, "read_part_into"):
                    dtype, shape = store.entry(name).part_spec(suffix)
                    store.read_part_into(name, suffix, np.empty(shape, dtype))
            finally:
                path.write_bytes(ws.originals[path])
    elif target == "manifest":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            store = NpyDir(ws.dir)
            tier_status(store)
            for name in list(store.entries)[:32]:
                store.dequantize(name)
                store.quantized(name)
            store.config()
    elif target in ("side_files", "tier_files"):
        from squishlike.config import ModelConfig, load_config

        def body(data: bytes) -> None:
            # one file of a built npy-dir replaced (its size kept where a sentinel records it, so the tier still
            # counts as ready and only the content checks stand between the bytes and a load)
            if not data:
                return
            rel = ws.files[data[0] % len(ws.files)]
            path, original = ws.dir / rel, ws.originals[rel]
            content = data[1:]
            if target == "tier_files" and original is not None:
                content = content[:len(original)].ljust(len(original), b" ")
            path.write_bytes(content)
            try:
                if target == "side_files":
                    ModelConfig.from_dict(load_config(ws.dir), ws.dir / "config.json")
                for tier in ORDER:
                    if tier.ready(ws.store)[0] is not None:
                        weights = tier.load(ws.store).weights
                        mx.eval(list(weights.values()))
            finally:
                path.write_bytes(original) if original is not None else path.unlink(missing_ok=True)
    elif target == "sentinel":
        def body(data: bytes) -> None:
            ws.file.write_bytes(data)
            (ws.dir / "finalized" / ".ready").write_bytes(data)
            read_sentinel(ws.file, ws.store.fingerprint)
            for tier in ORDER:
                tier.ready(ws.store)
            return
    else:
        raise SystemExit(f"unknown target {target!r}")

    strict = target == "sentinel"  # read_sentinel never raises: it says why a sentinel does not count

    def one_input(data: bytes) -> None:
        try:
            body(data)
        except SquishError:
            if strict:
                raise
        # Anything else propagates: atheris reports it as a crash, with the input.

    return one_input


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "--list"):
        print(__doc__)
        print("targets:", " ".join(TARGETS))
        return
    target = sys.argv[1]
    import warnings

    warnings.filterwarnings("ignore")  # numpy's SyntaxWarnings on hostile headers, tier warnings: log noise
    root = scratch()
    ws = Workspace(target, root)
    one_input = make_target(target, ws)
    for seed in sorted(ws.seeds.iterdir()):  # every seed must pass before fuzzing starts
        one_input(seed.read_bytes())
    argv = [sys.argv[0], *sys.argv[2:]]
    if not any(not a.startswith("-") for a in sys.argv[2:]):
        argv.append(str(ws.seeds))  # the corpus directory (libFuzzer adds new interesting inputs to it)
    print(f"fuzz target {target}: workspace {root}, {len(list(ws.seeds.iterdir()))} seeds", flush=True)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
