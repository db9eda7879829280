"""`squishlike server`'s model management and load policy: real server processes on 127.0.0.1, the `openai` client,
stores of the embedded SmolLM2 and of a tiny real qwen2, all under the test's temp dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import APIStatusError, NotFoundError, OpenAI

import squishlike
from support.net import free_port, wait_until_answers
from support.options import ROUND_TO_NEAREST
from support.tiny_models import TINY_CONFIGS, make_hf_model

pytestmark = pytest.mark.smollm

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def root(smollm_gguf, tokenizer_dir, tmp_path_factory) -> Path:
    """models/{smol-int8, smol-int4, tiny}: what the servers serve; outside/: stores no request may reach, one of
    them linked into models/ (float32 and no 4-bit tier: the fast CPU path)."""
    root = tmp_path_factory.mktemp("server")
    models, outside = root / "models", root / "outside"
    for fmt in ("int8", "int4"):
        squishlike.compress(smollm_gguf, models / f"smol-{fmt}", scheme=fmt, dtype="float32", tiers=("finalized",),
                            **ROUND_TO_NEAREST)
    for name, where in (("tiny", models), ("started-with", outside), ("secret", outside)):
        hf = make_hf_model(root / "hf" / name, TINY_CONFIGS["qwen2"], tokenizer_dir)
        squishlike.compress(hf, where / name, scheme="int8", dtype="float32", tiers=("finalized",))
    (models / "link-out").symlink_to(outside / "secret")
    return root


@contextmanager
def server(root: Path, *flags: object, startup_s: float = 120):
    """`squishlike server FLAGS` on 127.0.0.1 with no Hugging Face cache: (openai client, process, log path)."""
    port, log = free_port(), root / f"server-{time.monotonic_ns()}.log"
    env = {**os.environ, "HF_HOME": str(root / "no-hf-home"), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "squishlike", "server", "--port", str(port), *map(str, flags)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root,
        )
    try:
        wait_until_answers(process, f"http://127.0.0.1:{port}/health", log, startup_s)
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed", timeout=300, max_retries=0), \
            process, log
    finally:
        process.kill()
        process.wait(timeout=60)


def ps(client: OpenAI) -> dict:
    with urllib.request.urlopen(str(client.base_url).replace("/v1/", "/api/ps"), timeout=10) as reply:
        return json.load(reply)


def resident_names(client: OpenAI) -> list[str]:
    return [Path(m["name"]).name for m in ps(client)["models"]]


def rss(process: subprocess.Popen) -> int:
    status = Path(f"/proc/{process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def ask(client: OpenAI, model: str, **extra) -> str:
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, **extra)
    return reply.choices[0].message.content


def wait_until(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_lists_preloads_swaps_and_serves_two_models_at_once(root):
    started_with = root / "outside" / "started-with"
    with server(root, "--model", started_with, "--model-dir", root / "models", "--preload") as (client, _, log):
        # no Hugging Face cache at all: the list is the server's own models
        assert [m.id for m in client.models.list()] == [str(started_with), "smol-int4", "smol-int8", "tiny"]
        assert resident_names(client) == ["started-with"]  # --preload

        assert "Paris" in ask(client, "smol-int8")
        ask(client, str(root / "models" / "tiny"))  # by path as well as by name
        assert resident_names(client) == ["tiny", "smol-int8", "started-with"]  # most recently used first
        assert "loaded" in log.read_text() and "GB of the" in log.read_text()

        replies = {}
        threads = [threading.Thread(target=lambda m=m: replies.update({m: ask(client, m)}))
                   for m in ("smol-int8", "smol-int4", "tiny", "smol-int8")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert "Paris" in replies["smol-int8"] and "Paris" in replies["smol-int4"] and "tiny" in replies
        assert sorted(resident_names(client)) == ["smol-int4", "smol-int8", "started-with", "tiny"]


def test_idle_models_unload_and_give_their_memory_back(root):
    with server(root, "--model-dir", root / "models", "--keep-alive", "2") as (client, process, log):
        before = rss(process)
        ask(client, "smol-int8")
        loaded = rss(process)
        size = ps(client)["models"][0]["size"]
        assert size > 500e6 and loaded - before > size / 2
        wait_until(lambda: not ps(client)["models"])
        assert loaded - rss(process) > size / 2
        assert "unloaded" in log.read_text() and "idle for its keep-alive of 2 s" in log.read_text()

        ask(client, "tiny", extra_body={"keep_alive": -1})  # a request's keep_alive: this one stays
        ask(client, "smol-int4", extra_body={"keep_alive": "1s"})
        wait_until(lambda: resident_names(client) == ["tiny"])
        assert ps(client)["models"][0]["expires_at"] is None
        with pytest.raises(APIStatusError) as refused:
            ask(client, "tiny", extra_body={"keep_alive": "soon"})
        assert refused.value.status_code == 400 and "keep_alive='soon'" in refused.value.response.json()["error"]


def test_a_budget_for_one_model_evicts_the_least_recently_used(root):
    with server(root, "--model-dir", root / "models", "--max-memory", "800MB") as (client, _, log):
        ask(client, "tiny")
        ask(client, "smol-int8")
        assert "Paris" in ask(client, "smol-int4")
        assert resident_names(client) == ["smol-int4"]
        assert ps(client)["resident"] <= 800e6
        assert "unloaded" in log.read_text() and "to make room for" in log.read_text()
        ask(client, "tiny")  # known now and small: it fits beside smol-int4
        assert resident_names(client) == ["tiny", "smol-int4"]


def test_a_long_generation_blocks_no_other_model_and_a_swap_waits_at_most_max_wait(root):
    with server(root, "--model-dir", root / "models", "--max-memory", "800MB", "--max-wait", "1") as (client, _, _):
        ask(client, "tiny")
        long = client.completions.create(model="smol-int8", prompt="1, 2, 3, 4, 5, 6, 7,", max_tokens=2000,
                                         temperature=0, stream=True)
        next(iter(long))  # smol-int8 is generating (counting, for long)
        started = time.monotonic()
        ask(client, "tiny")  # resident beside it: served at once, on its own thread
        with pytest.raises(APIStatusError) as busy:  # smol-int4 needs smol-int8's memory
            ask(client, "smol-int4")
        assert busy.value.status_code == 503 and "--max-wait" in busy.value.response.json()["error"]
        assert time.monotonic() - started < 60
        long.close()


def test_only_the_allowed_models_are_served_and_nothing_is_written_elsewhere(root):
    outside = root / "outside"
    before = sorted(str(p) for p in outside.rglob("*"))
    with server(root, "--model-dir", root / "models") as (client, _, log):
        refused = []
        for name in (str(outside / "secret"), "../outside/secret", "link-out", str(root / "no-such-store"),
                     "no-such-store", "HuggingFaceTB/SmolLM2-135M", "a" * 5000, "tiny\x00"):
            with pytest.raises(NotFoundError) as e:
                ask(client, name)
            refused.append(e.value.response.json()["error"].replace(name, "NAME"))
        assert len(set(refused)) == 1, refused  # the same answer whatever exists on disk
        assert "huggingface" not in refused[0].lower() and "cache" not in refused[0]
        assert not ps(client)["models"]
    assert sorted(str(p) for p in outside.rglob("*")) == before


def test_hub_repo_ids_only_with_allow_hub(root):
    with server(root, "--model-dir", root / "models", "--allow-hub") as (client, _, _log):
        with pytest.raises(APIStatusError) as e:  # offline here: the repo is asked for, and not found
            ask(client, "HuggingFaceTB/no-such-repo")
        message = e.value.response.json()["error"]
        assert e.value.status_code == 404 and "only its --model" not in message
        assert "cache" not in message and str(root) not in message
        with pytest.raises(NotFoundError):  # a local path stays refused
            ask(client, str(root / "outside" / "secret"))
