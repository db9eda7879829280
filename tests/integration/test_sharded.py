"""squishlike.sharded_load under `mlx.launch -n 2 --backend ring` on 127.0.0.1: each rank's logits, the bytes it
reads, and the rank tier a second launch takes.

Pipeline parallelism runs the same float ops as one process, so its logits must be bit-identical to
squishlike.load of the same store. Tensor parallelism sums partial products across ranks, which rounds
differently from one process; there the bar is mlx_lm.sharded_load of the same weights (the store exported dense):
bit-identical to it, on the same split.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from benchmarks.bench_sharded import ring_starting_port
from support import shard_rank
from support.arch_sweep import ARCH_CONFIGS
from support.tiny_models import MINISTRAL3, TINY_CONFIGS, make_hf_model, mlx_quantized

import squishlike
from squishlike.npydir import NpyDir

RANKS = 2
LAUNCH_TIMEOUT_S = 240
# The tensors a model's shard() cuts (Q/K/V with their biases, the output projection, the MLP); the rest is
# replicated on every rank.
TENSOR_SHARDED = re.compile(
    r"layers\.\d+\.(attention\.[qkv]\.(weight|bias)|attention\.output\.weight|ffn\.\w+\.weight)")
# The tensors a pipeline splits: those of the layers, under canonical names ("layers.3.") or, for an architecture
# without a rule table, mlx_lm's ("model.layers.3.").
LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\..*")


def _env() -> dict[str, str]:
    """The environment of every process a test starts: this checkout's squishlike first."""
    return {**os.environ, "PYTHONPATH": str(Path(squishlike.__file__).parents[1])}


def _run_launch(command: list[str]) -> tuple[str, str]:
    """`mlx.launch -n RANKS --backend ring` of `command` on 127.0.0.1; the ranks' stdout and stderr. Bounded in
    time: on a timeout the whole process group is killed. `--` keeps mlx.launch from taking the command's flags
    that it also has (`--verbose`)."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    for _ in range(3):
        process = subprocess.Popen(
            [str(launcher), "-n", str(RANKS), "--backend", "ring", "--starting-port", str(ring_starting_port(RANKS)),
             "--", *command],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=_env())
        try:
            stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            pytest.fail(f"mlx.launch did not finish in {LAUNCH_TIMEOUT_S} s")
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        # The ports were free when chosen; another process (a run beside this one) may still bind one first. The
        # ranks fail in mx.distributed.init, before they read or write anything, so a launch on other ports is
        # the same launch.
        if not re.search(r"\[ring\] Couldn't (bind|listen)", stderr):
            break
    # mlx.launch exits 0 even when a rank fails; it says so on stderr
    assert process.returncode == 0 and "exited with code" not in stderr, stderr[-4000:]
    return stdout, stderr


def launch(model: Path, mode: str, out: Path, reference: Path | None = None) -> list[dict]:
    """tests/support/shard_rank.py on RANKS ranks: each rank's logits, load record and models (shard_rank.describe,
    under "models")."""
    out.mkdir(parents=True, exist_ok=True)
    _, stderr = _run_launch([sys.executable, shard_rank.__file__, str(model), mode, str(out),
                             *([str(reference)] if reference else [])])
    assert all((out / f"rank{r}.json").exists() for r in range(RANKS)), stderr[-4000:]
    results = []
    for r in range(RANKS):
        report = json.loads((out / f"rank{r}.json").read_text())
        results.append({**dict(np.load(out / f"rank{r}.npz")), "load": report["loads"][0], "models": report["models"]})
    return results


def single_logits(model) -> np.ndarray:
    return shard_rank.logits(model)


def stored_bytes(store: NpyDir, name: str) -> int:
    entry = store.entries[name]
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in map(entry.part_spec, entry.kind.suffixes))


def share_bound(store: NpyDir, mode: str, rank: int) -> int:
    """The stored bytes `rank` may read: all of the replicated tensors, plus 1/RANKS of the tensors a tensor split
    cuts, or all of the tensors of the layers of its pipeline stage (stages differ in size where layers do)."""
    total = {n: stored_bytes(store, n) for n in store.entries}
    if mode == "tensor":
        split = {n for n in total if TENSOR_SHARDED.fullmatch(n)}
        share = sum(total[n] for n in split) // RANKS
    else:
        split = {n for n in total if LAYER.fullmatch(n)}
        stage = stage_layers(store.config(), rank)
        share = sum(total[n] for n in split if int(LAYER.fullmatch(n).group(1)) in stage)
    return sum(b for n, b in total.items() if n not in split) + share


def stage_layers(config: dict, rank: int) -> range:
    """The layers mlx_lm's own `pipeline()` gives `rank` of RANKS (the last layers go to rank 0)."""
    from squishlike.model import new_model

    model = new_model(config).model
    model.pipeline(SimpleNamespace(rank=lambda: rank, size=lambda: RANKS))
    return range(model.start_idx, model.end_idx)


CASES = [  # (architecture, config, mode, store format, launch a second time)
    ("llama", TINY_CONFIGS["llama"], "tensor", "int8", True),
    ("qwen2", TINY_CONFIGS["qwen2"], "tensor", "int4", False),
    ("qwen3", TINY_CONFIGS["qwen3"], "tensor", "int4", False),
    ("qwen2", TINY_CONFIGS["qwen2"], "pipeline", "int8", False),
    ("ministral3", MINISTRAL3, "pipeline", "int4", True),
    # Multi-head latent attention, a dense first layer and a mixture of experts (float32: on mlx[cpu] the experts'
    # gather_mm runs in float32 only).
    ("deepseek_v3", ARCH_CONFIGS["deepseek_v3"], "pipeline", "int4", False),
]


@pytest.mark.parametrize("arch,config,mode,fmt,relaunch", CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_sharded_store(tmp_path, tokenizer_dir, arch, config, mode, fmt, relaunch):
    src = make_hf_model(tmp_path / "src", config, tokenizer_dir)
    store_path = tmp_path / "store"
    squishlike.compress(src, store_path, scheme=fmt, group_size=32, tiers=["finalized"])
    store = NpyDir(store_path)
    expected = single_logits(squishlike.load(store_path)[0])
    reference = None
    if mode == "tensor":  # mlx_lm.sharded_load of the same weights, dense
        reference = squishlike.export(store_path, "mlx", tmp_path / "dense")
        assert np.array_equal(single_logits(mlx_lm.load(str(reference))[0]), expected)

    first = launch(store_path, mode, tmp_path / "first", reference)
    for rank, result in enumerate(first):
        bound = share_bound(store, mode, rank)
        assert result["load"]["layout"] == f"{mode}-{RANKS}-{rank}"
        assert result["load"]["tier"] == "store"
        assert 0 < result["load"]["bytes_read"] <= bound * 1.05, (result["load"], bound)
        if mode == "pipeline":
            assert np.array_equal(result["ours"], expected)
        else:
            assert np.array_equal(result["ours"], result["mlx_lm"])
            assert np.allclose(result["ours"], expected, atol=1e-4)
    shares = sorted(p.name for p in (store_path / "shards").iterdir() if not p.name.endswith(".lock"))  # per layout
    assert shares == [f"{mode}-{RANKS}-{r}" for r in range(RANKS)]
    if not relaunch:  # each launch costs seconds of imports per rank; two cases show the second launch
        return

    second = launch(store_path, mode, tmp_path / "second")
    for rank, result in enumerate(second):
        assert result["load"]["tier"] == "rank"
        assert np.array_equal(result["ours"], first[rank]["ours"])


def test_a_share_from_another_store_is_not_served_under_mlx_launch(tmp_path, tokenizer_dir):
    """Two stores of one architecture, each with its rank shares built by a launch: the other store's share files
    copied over this one's (same sizes, sentinels kept). The next launch of this store hashes them (their identity is
    not the one its sentinels recorded), reads and caches its own shares again, and gives its own logits."""
    stores, first = [], []
    for name, seed in (("store", 0), ("other", 7)):
        src = make_hf_model(tmp_path / f"{name}-src", TINY_CONFIGS["llama"], tokenizer_dir, seed=seed)
        stores.append(squishlike.compress(src, tmp_path / name, scheme="int8", group_size=32, tiers=()))
        first.append(launch(stores[-1], "tensor", tmp_path / f"{name}-first"))
    store, other = stores
    for rank in range(RANKS):
        share = store / "shards" / f"tensor-{RANKS}-{rank}" / "weights.safetensors"
        foreign = other / "shards" / f"tensor-{RANKS}-{rank}" / "weights.safetensors"
        assert share.stat().st_size == foreign.stat().st_size and share.read_bytes() != foreign.read_bytes()
        shutil.copyfile(foreign, share)
    for rank, result in enumerate(launch(store, "tensor", tmp_path / "second")):
        assert result["load"]["tier"] == "store", result["load"]
        assert np.array_equal(result["ours"], first[0][rank]["ours"])
        assert not np.array_equal(result["ours"], first[1][rank]["ours"])


def test_inspect_and_verify_list_rank_shares(tiny_llama, tmp_path):
    """inspect lists each layout's cached share (ready or why not, its size on disk); verify checks each share's
    checksums as it does a tier's. The shares are built directly, as sharded_load builds them, with no launch."""
    from squishlike.cli.inspect import summary
    from squishlike.info import inspect_model, verify
    from squishlike.tiers.rank import RankTier

    store_path = squishlike.compress(tiny_llama, tmp_path / "store", scheme="int8", tiers=["finalized"])
    store = NpyDir(store_path)
    dense = {name: store.dequantize(name) for name in sorted(store.entries)[:2]}
    for key in ("pipeline-2-0", "tensor-2-0", "tensor-2-1"):
        RankTier(key, plan="a split").build(store, dense)
    shards = store_path / "shards"
    (shards / ".tensor-2-0.tmp-0123").mkdir()  # a build in progress: not a share
    stale = shards / "pipeline-2-0" / ".ready"
    stale.write_text(json.dumps({**json.loads(stale.read_text()), "manifest_fingerprint": "another manifest"}))
    damaged = shards / "tensor-2-1" / "weights.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))

    report = inspect_model(store_path)
    on_disk = {key: sum(f.stat().st_size for f in (shards / key).iterdir()) for key in report["rank_caches"]}
    assert report["rank_caches"] == {  # inspect reads sizes only: the damaged share still looks ready
        "pipeline-2-0": {"state": "stale (made for another manifest)", "bytes": on_disk["pipeline-2-0"]},
        "tensor-2-0": {"state": "ready", "bytes": on_disk["tensor-2-0"]},
        "tensor-2-1": {"state": "ready", "bytes": on_disk["tensor-2-1"]},
    }
    assert any(line.split()[:3] == ["rank", "shares", "pipeline-2-0"] for line in summary(report))

    problems = verify(store_path)
    assert len(problems) == 2, problems
    assert f"tier rank: {stale} does not count (stale (made for another manifest))" in problems
    assert any(line.startswith(f"tier rank: {damaged}") for line in problems), problems


def test_sharded_provider_source(tmp_path, tokenizer_dir):
    """A source that is not an npy-dir (here an HF directory) loads through the provider: the same share as
    mlx_lm.sharded_load of that directory, bit for bit, and nothing is cached next to it.

    The share is compared parameter by parameter. The logits agree to float32 rounding, not bit for bit: with
    OpenBLAS preloaded (scripts/test.sh), the two models' forward passes under mlx.launch differed by up to 1.7e-6
    on logits of ~2 although every parameter was the same bits (without OpenBLAS, and in one process, they are
    equal)."""
    src = make_hf_model(tmp_path / "src", TINY_CONFIGS["qwen3"], tokenizer_dir)
    for result in launch(src, "tensor", tmp_path / "out", src):
        assert result["load"]["tier"] == "hf"
        assert result["models"]["ours"] == result["models"]["mlx_lm"]  # classes, dtypes, shapes, digests of bits
        np.testing.assert_allclose(result["ours"], result["mlx_lm"], rtol=1e-5, atol=1e-5)
    assert not (src / "shards").exists()


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_sharded_mlx_quantized_source(tmp_path, tokenizer_dir, mode):
    """An MLX-quantized directory (mlx_lm.convert -q) stays quantized, as mlx_lm.sharded_load keeps it: on each
    rank the same module classes (the quantized sharded linears under tensor parallelism), every parameter bit for
    bit, the same logits; a pipeline stage reads only its own layers' triples."""
    src = mlx_quantized(tmp_path, tokenizer_dir, TINY_CONFIGS["qwen2"], q_bits=4)
    stored = {name: a.nbytes for f in src.glob("model*.safetensors") for name, a in mx.load(str(f)).items()}
    for rank, result in enumerate(launch(src, mode, tmp_path / "out", src)):
        ours, reference = result["models"]["ours"], result["models"]["mlx_lm"]
        assert ours == reference
        assert any(c.startswith("Quantized") for c in ours["modules"].values())
        if mode == "tensor":
            assert {"QuantizedAllToShardedLinear", "QuantizedShardedToAllLinear"} <= set(ours["modules"].values())
        else:
            stage = stage_layers(json.loads((src / "config.json").read_text()), rank)
            share = [b for name, b in stored.items() if not (m := LAYER.fullmatch(name)) or int(m.group(1)) in stage]
            assert 0 < result["load"]["bytes_read"] <= sum(share) < sum(stored.values())
        assert result["load"]["tier"] == "mlx"
        assert np.array_equal(result["ours"], result["mlx_lm"])


@pytest.fixture(scope="module")
def generate_run(tmp_path_factory, tokenizer_dir) -> tuple[list[str], Path, str]:
    """A `squishlike generate` command line (greedy, a few tokens) on a tiny store, the store, and what one
    process prints for it; shared by the launches below."""
    tmp = tmp_path_factory.mktemp("generate")
    store_path = tmp / "store"
    squishlike.compress(make_hf_model(tmp / "src", TINY_CONFIGS["qwen2"], tokenizer_dir), store_path,
                        scheme="int8", tiers=["finalized"])
    command = [sys.executable, "-m", "squishlike", "generate", "--model", str(store_path), "--prompt",
               "The capital of France", "--max-tokens", "6", "--temp", "0", "--verbose", "False"]
    single = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=LAUNCH_TIMEOUT_S)
    assert single.returncode == 0 and single.stdout.strip(), single.stderr[-4000:]
    return command, store_path, single.stdout


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_generate_under_mlx_launch(generate_run, mode):
    """`squishlike generate` on RANKS ranks loads each rank's share and prints, once (rank 0), the greedy text one
    process prints."""
    command, store_path, expected = generate_run
    stdout, _ = _run_launch([*command, *(["--pipeline"] if mode == "pipeline" else [])])
    assert stdout == expected
    assert {f"{mode}-{RANKS}-{r}" for r in range(RANKS)} <= {p.name for p in (store_path / "shards").iterdir()}


def test_generate_sharded_loader_refuses_what_a_share_cannot_take():
    """Under mlx.launch, mlx_lm generate's adapter and activation quantization are refused, not dropped."""
    from squishlike.cli.generate import sharded_loader

    load = sharded_loader(None)
    with pytest.raises(ValueError, match="adapters"):
        load("model", adapter_path="adapter")
    with pytest.raises(ValueError, match="quantize_activations"):
        load("model", model_config={"quantize_activations": True})


@pytest.mark.parametrize("tool", ["chat", "server"])
def test_tools_take_squishlike_sharded_load(monkeypatch, tool):
    """`squishlike chat` and `squishlike server` run mlx_lm's own tools, which call `sharded_load` when launched on
    several ranks: while they run, that name is squishlike's, and mlx_lm's again afterwards."""
    import importlib

    import mlx_lm.utils

    from squishlike.mlx_lm_tools import run_tool
    from squishlike.load.sharded import sharded_load

    module = importlib.import_module(f"mlx_lm.{tool}")
    seen = []
    monkeypatch.setattr(module, "main", lambda: seen.append(module.sharded_load))
    run_tool(tool, [])
    assert seen == [sharded_load] and module.sharded_load is mlx_lm.utils.sharded_load
    run_tool(tool, [], max_memory=3 * 10**9)  # --max-memory: each rank streams its experts within it
    assert seen[-1].func is sharded_load and seen[-1].keywords == {"max_memory": 3 * 10**9}
