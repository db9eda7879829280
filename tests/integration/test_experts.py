"""Loads within a memory budget (squishlike/load/): a tiny real qwen3_moe, random weights, in an INT4 store, its
experts streamed from the store under a max_memory it does not fit, against the resident load of the same store;
a dense model over the budget refused before anything is read; `generate` and `server` with --max-memory."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate
from openai import OpenAI

import squishlike
from squishlike.errors import MemoryBudgetError
from squishlike.load.budget import held_bytes
from squishlike.load.experts import expert_cache
from squishlike.npydir import NpyDir
from squishlike.server import model_nbytes
from support.arch_sweep import HAND
from support.net import free_port, wait_until_answers
from support.tiny_models import TINY_CONFIGS, make_hf_model

# 8 experts of 2 per token, so a token's routed experts are a quarter of them.
MOE = {**HAND["qwen3_moe"], "num_experts": 8}
PROMPT = list(range(3, 43))  # 40 tokens: 80 (token, expert) pairs, which SwitchGLU sorts


def sizes(store: Path) -> tuple[int, int, int]:
    """(the whole model's bytes in memory, the expert stacks', the largest stack's)."""
    opened = NpyDir(store)
    stacks = [held_bytes(opened, e) for name, e in opened.entries.items() if ".switch_mlp." in name]
    return sum(held_bytes(opened, e) for e in opened.entries.values()), sum(stacks), max(stacks, default=0)


@pytest.fixture(scope="module")
def moe_store(tokenizer_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("experts")
    hf = make_hf_model(root / "hf", MOE, tokenizer_dir)
    squishlike.compress(hf, root / "store", scheme="int4", dtype="float32")
    return root / "store"


def smallest_budget(store: Path) -> int:
    """The least max_memory a streamed load takes: the resident part, and the largest stack cached and gathered."""
    whole, experts, largest = sizes(store)
    return whole - experts + 2 * largest


def test_streamed_experts_give_the_resident_loads_logits_and_tokens_within_the_budget(moe_store):
    resident, tokenizer = squishlike.load(moe_store)
    budget = smallest_budget(moe_store)
    streamed, _ = squishlike.load(moe_store, max_memory=budget)
    cache = expert_cache(streamed)
    assert cache is not None and expert_cache(resident) is None
    assert model_nbytes(streamed) <= budget < sizes(moe_store)[0]
    for tokens in (PROMPT, PROMPT[:3], PROMPT[:1]):  # a prompt (sorted indices), a few tokens, one
        expected = resident(mx.array([tokens]))
        assert mx.array_equal(streamed(mx.array([tokens])), expected).item()
        assert cache.used <= cache.capacity
    assert cache.stats.misses > 0
    prompt = "The quick brown fox"
    assert generate(streamed, tokenizer, prompt, max_tokens=24) == generate(resident, tokenizer, prompt, max_tokens=24)
    assert cache.used <= cache.capacity


def test_a_prompt_reads_each_routed_expert_once(moe_store):
    streamed, _ = squishlike.load(moe_store, max_memory=sizes(moe_store)[0] - 1)
    cache = expert_cache(streamed)
    mx.eval(streamed(mx.array([PROMPT])))
    # 40 tokens route 80 (token, expert) pairs in each of 6 stacks; each stack's 8 experts are read once at most
    stacks, experts = len(cache.stacks), MOE["num_experts"]
    assert cache.stats.hits == 0 and stacks * experts // 2 < cache.stats.misses <= stacks * experts
    (per_expert,) = {stack.expert_bytes for stack in cache.stacks.values()}
    assert cache.stats.bytes_read == cache.stats.misses * per_expert


def test_a_model_that_fits_loads_whole(moe_store):
    whole, _, _ = sizes(moe_store)
    model, _ = squishlike.load(moe_store, max_memory=whole)
    assert expert_cache(model) is None
    resident, _ = squishlike.load(moe_store)
    assert mx.array_equal(model(mx.array([PROMPT])), resident(mx.array([PROMPT]))).item()


def test_a_budget_below_the_experts_least_is_refused_naming_both_sizes(moe_store):
    budget = smallest_budget(moe_store) - 1
    with pytest.raises(MemoryBudgetError) as refused:
        squishlike.load(moe_store, max_memory=budget)
    assert str(moe_store) in str(refused.value) and f"max_memory is {budget} bytes" in str(refused.value)
    assert f"at least {budget + 1} bytes" in str(refused.value)


def test_a_dense_model_over_the_budget_is_refused_before_anything_is_read(tokenizer_dir, tmp_path):
    store = tmp_path / "store"
    squishlike.compress(make_hf_model(tmp_path / "hf", TINY_CONFIGS["qwen3"], tokenizer_dir), store,
                        scheme="int4", dtype="float32")
    whole = sizes(store)[0]
    (store / "tensors").rename(tmp_path / "away")  # a load that read a weight would fail on the missing packs
    with pytest.raises(MemoryBudgetError) as refused:
        squishlike.load(store, max_memory="100KB")
    assert f"needs {whole} bytes" in str(refused.value) and "max_memory is 100000 bytes" in str(refused.value)
    (tmp_path / "away").rename(store / "tensors")
    model, _ = squishlike.load(store, max_memory=whole)  # nothing lost: the store loads whole within its size
    assert expert_cache(model) is None


def test_generate_streams_experts_and_reports_the_cache(moe_store):
    run = subprocess.run([sys.executable, "-m", "squishlike", "generate", "--model", str(moe_store), "--max-memory",
                          str(smallest_budget(moe_store)), "--prompt", "The quick", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Generation: 8 tokens" in run.stdout and "expert cache: hit rate" in run.stderr


def test_the_server_answers_a_chat_with_streamed_experts_within_max_memory(moe_store, tmp_path):
    budget = smallest_budget(moe_store)
    port, log = free_port(), tmp_path / "server.log"
    env = {**os.environ, "HF_HOME": str(tmp_path / "no-hf-home"), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "squishlike", "server", "--port", str(port), "--model",
                                    str(moe_store), "--max-memory", str(budget)], stdout=out,
                                   stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        wait_until_answers(process, f"http://127.0.0.1:{port}/health", log, 120)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed", timeout=300, max_retries=0)
        reply = client.chat.completions.create(model="default_model", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Hello?"}])
        assert reply.choices[0].message.content
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/ps", timeout=10) as answer:
            figures = json.load(answer)
        assert 0 < figures["resident"] <= budget < sizes(moe_store)[0]
    finally:
        process.kill()
        process.wait(timeout=60)


def test_the_server_counts_a_streamed_models_budget_and_leaves_mlx_only_the_rest(moe_store):
    """The server's MLX buffer cache (freed buffers the process keeps) gets the bytes the budget leaves beside the
    resident models, no more: a limit of the whole budget let a streamed model's prompt pass keep every stack it
    gathered and freed, on top of the model (docs/design.md §9.4)."""
    from squishlike.mlx_lm_tools import run_tool
    from squishlike.server import ModelManager, ServerOptions

    cli_args = []  # mlx_lm's server flags, parsed by mlx_lm's own parser
    run_tool("server", ["--model", str(moe_store)],
             seams={"run": lambda host, port, provider: cli_args.append(provider.cli_args)})
    budget = smallest_budget(moe_store)
    least = mx.set_cache_limit(0)  # MLX's own limit, the least the server leaves its cache: none here
    manager = ModelManager(cli_args[0], ServerOptions(max_memory=budget),
                           functools.partial(squishlike.load, max_memory=budget))
    try:
        resident = manager.acquire("default_model")
        manager.release(resident)
        assert resident.nbytes == budget  # the resident part, the cache of experts and one gathered stack
        model = resident.generator.model_provider.model
        assert expert_cache(model) is not None
        mx.clear_cache()
        mx.eval(model(mx.array([PROMPT])))  # a prompt's pass: every stack gathered, multiplied and freed
        assert mx.get_cache_memory() == 0
    finally:
        manager.stop_and_join()
        mx.set_cache_limit(least)


def test_bf16_experts_take_the_float32_cpu_path_streamed_or_resident_alike(tokenizer_dir, tmp_path):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from squishlike.cpu_layers import CpuQuantizedSwitchLinear

    store = tmp_path / "store"
    squishlike.compress(make_hf_model(tmp_path / "hf", MOE, tokenizer_dir), store, scheme="int4", dtype="bfloat16")
    resident, _ = squishlike.load(store)
    stacks = [m for _, m in resident.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert stacks and all(type(m) is CpuQuantizedSwitchLinear for m in stacks)
    streamed, _ = squishlike.load(store, max_memory=smallest_budget(store))
    expected = resident(mx.array([PROMPT]))
    assert expected.dtype == mx.bfloat16 and mx.array_equal(streamed(mx.array([PROMPT])), expected).item()
    for m in stacks:  # MLX's own bf16 gather_qmm: the same model, within bf16's rounding
        m.__class__ = QuantizedSwitchLinear
    bf16 = resident(mx.array([PROMPT])).astype(mx.float32)
    cosine = (mx.sum(bf16 * expected) / (mx.linalg.norm(bf16) * mx.linalg.norm(expected.astype(mx.float32)))).item()
    assert cosine > 0.99


def test_inspect_names_the_experts_and_the_least_budget(moe_store):
    from squishlike.info import inspect_model

    whole, experts, _ = sizes(moe_store)
    assert inspect_model(moe_store)["memory"] == {"resident_load": whole, "experts": experts, "expert_stacks": 6,
                                                  "least_max_memory": smallest_budget(moe_store)}
    with pytest.raises(MemoryBudgetError):
        squishlike.load(moe_store, max_memory=smallest_budget(moe_store) - 1)


def test_a_budget_that_is_no_size_or_a_forced_tier_with_streaming_is_refused(moe_store):
    with pytest.raises(ValueError, match="expected a size such as 8GB"):
        squishlike.load(moe_store, max_memory="lots")
    with pytest.raises(ValueError, match="experts are streamed from the store"):
        squishlike.load(moe_store, max_memory=smallest_budget(moe_store), tier="int4")
    run = subprocess.run([sys.executable, "-m", "squishlike", "chat", "--model", str(moe_store), "--max-memory",
                          "lots"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "expected a size such as 8GB" in run.stderr
    model, _ = squishlike.load(moe_store, max_memory=smallest_budget(moe_store))  # the store is as it was
    assert expert_cache(model) is not None


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_other_moe_families_stream_exactly(family, tokenizer_dir, tmp_path):
    """qwen2_moe (a shared expert beside the routed ones) and mixtral (its own names for the stacks)."""
    store = tmp_path / "store"
    squishlike.compress(make_hf_model(tmp_path / "hf", HAND[family], tokenizer_dir), store, scheme="int4",
                        dtype="float32")
    resident, tokenizer = squishlike.load(store)
    streamed, _ = squishlike.load(store, max_memory=smallest_budget(store))
    assert expert_cache(streamed) is not None
    assert mx.array_equal(streamed(mx.array([PROMPT])), resident(mx.array([PROMPT]))).item()
    assert generate(streamed, tokenizer, "The quick", max_tokens=8) == generate(resident, tokenizer, "The quick",
                                                                                 max_tokens=8)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sharded_rank_streams_its_own_share_of_the_experts(moe_store, rank):
    """sharded_load under max_memory: rank `rank` of a tensor split in two (one process: its layers are run one by
    one, a whole forward would wait for the other rank's sums) keeps its dense share of the rest and reads its own
    rows (up, gate) or columns (down) of each routed expert, quantized, from the store; each expert stack computes
    what the rank's resident share computes. A group of one runs the whole model: the resident share's logits."""
    from types import SimpleNamespace

    from mlx.utils import tree_flatten

    from squishlike.load.sharded import sharded_load

    group = SimpleNamespace(rank=lambda: rank, size=lambda: 2)
    resident, _ = sharded_load(moe_store, tensor_group=group)
    held = dict(tree_flatten(resident.parameters()))
    rest = sum(v.nbytes for name, v in held.items() if ".switch_mlp." not in name)
    opened = NpyDir(moe_store)
    largest = max(held_bytes(opened, e) for name, e in opened.entries.items() if ".switch_mlp." in name) // 2
    with pytest.raises(MemoryBudgetError, match=f"at least {rest + 2 * largest} bytes"):
        sharded_load(moe_store, tensor_group=group, max_memory=rest + 2 * largest - 1)
    streamed, _ = sharded_load(moe_store, tensor_group=group, max_memory=rest + 2 * largest)
    cache = expert_cache(streamed)
    assert cache is not None and cache.capacity == largest  # one stack's share of the experts at a time
    parameters = dict(tree_flatten(streamed.parameters()))
    assert parameters.keys() == {name for name in held if not name.endswith("switch_mlp.up_proj.weight")
                                 and not name.endswith("switch_mlp.gate_proj.weight")
                                 and not name.endswith("switch_mlp.down_proj.weight")}
    assert all(mx.array_equal(parameters[name], held[name]).item() for name in parameters)
    x = mx.random.normal((1, len(PROMPT), MOE["hidden_size"]), key=mx.random.key(rank))
    indices = mx.random.randint(0, MOE["num_experts"], (1, len(PROMPT), 2), key=mx.random.key(7))
    for ours, theirs in zip(streamed.model.layers, resident.model.layers):
        expected = theirs.mlp.switch_mlp(x, indices)
        assert mx.allclose(ours.mlp.switch_mlp(x, indices), expected, atol=1e-5).item()
    assert cache.stats.misses > MOE["num_experts"] and cache.used <= cache.capacity
    assert (moe_store / "shards" / f"tensor-2-{rank}.experts-streamed").is_dir()  # beside the whole share's

    whole, _ = sharded_load(moe_store)  # a group of one: every layer here
    budget = smallest_budget(moe_store) + sum(v.nbytes for name, v in tree_flatten(whole.parameters())) // 2
    streamed, _ = sharded_load(moe_store, max_memory=budget)
    assert expert_cache(streamed) is not None
    assert mx.allclose(streamed(mx.array([PROMPT])), whole(mx.array([PROMPT])), atol=1e-4).item()


def test_a_ranks_part_of_an_expert_that_is_not_one_run_of_whole_groups_is_refused(moe_store):
    from squishlike.load.experts import ExpertCache

    opened = NpyDir(moe_store)
    name = next(n for n in opened.entries if ".switch_mlp." in n and "down" in n)
    group = opened.entries[name].group_size
    for kept in ((2, np.arange(1, 1 + group)), (1, np.array([0, 2])), (0, np.arange(2))):  # mid-group, gaps, experts
        with pytest.raises(MemoryBudgetError, match="cannot be streamed"):
            ExpertCache(opened, [name], 10**6, kept={name: kept})
    assert ExpertCache(opened, [name], 10**6, kept={name: (2, np.arange(group))}).stacks[name].expert_bytes > 0
