"""mlx_lm's own server, chat and generate, run on squishlike stores: real processes, a real HTTP client (openai),
stores of the embedded SmolLM2 compressed here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import mlx_lm
import pytest
from openai import NotFoundError, OpenAI

import squishlike
from squishlike.errors import IncompatibleVersionError
from squishlike.mlx_lm_tools import TESTED_MLX_LM, check_mlx_lm_version
from support.net import free_port, wait_until_answers
from support.options import ROUND_TO_NEAREST

pytestmark = pytest.mark.smollm

QUESTION = "What is the capital of France?"
SPEED_LINES = (r"^Prompt: \d+ tokens, [\d.]+ tokens-per-sec$", r"^Generation: \d+ tokens, [\d.]+ tokens-per-sec$",
               r"^Peak memory: [\d.]+ GB$")


@pytest.fixture(scope="module")
def stores(smollm_gguf, tmp_path_factory) -> dict[str, Path]:
    # float32 and no 4-bit tier: plain float32 Linear layers, the fast CPU path for these forward passes
    root = tmp_path_factory.mktemp("tools")
    return {
        fmt: squishlike.compress(smollm_gguf, root / fmt, scheme=fmt, dtype="float32", tiers=("finalized",),
                                  **ROUND_TO_NEAREST)
        for fmt in ("int8", "int4")
    }


def squishlike_command(*args: object) -> list[str]:
    return [sys.executable, "-m", "squishlike", *map(str, args)]


def run(*args: object, stdin: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(squishlike_command(*args), input=stdin, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done


@contextmanager
def running_server(model: Path, log: Path, startup_s: float = 300):
    """`squishlike server --model MODEL --model-dir (its parent)` on a free port of 127.0.0.1; its base URL once it
    answers. Always killed."""
    port = free_port()
    with open(log, "w") as out:
        server = subprocess.Popen(
            squishlike_command("server", "--model", model, "--model-dir", model.parent, "--port", port,
                               "--log-level", "DEBUG"),
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        wait_until_answers(server, f"http://127.0.0.1:{port}/v1/models", log, startup_s)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.kill()
        server.wait(timeout=60)


def test_server_answers_openai_requests_and_switches_stores(stores, tmp_path):
    log = tmp_path / "server.log"
    ask = [{"role": "user", "content": QUESTION}]
    with running_server(stores["int8"], log) as base_url:
        client = OpenAI(base_url=base_url, api_key="not-needed", timeout=600)
        reply = client.chat.completions.create(model=str(stores["int8"]), messages=ask, max_tokens=10, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        assert f"{stores['int4']}: weights from the" not in log.read_text()

        chunks = client.chat.completions.create(model=str(stores["int4"]), messages=ask, max_tokens=10, temperature=0,
                                                stream=True)
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(deltas) > 1 and "Paris" in "".join(deltas)
        # squishlike.load logged loading the second store for that request (DEBUG)
        assert f"{stores['int4']}: weights from the" in log.read_text()

        missing = tmp_path / "no-such-store"
        with pytest.raises(NotFoundError) as refused:
            client.chat.completions.create(model=str(missing), messages=ask, max_tokens=2)
        assert f"{missing}: this server serves only" in refused.value.response.json()["error"]


def test_generate_reads_stdin_and_prints_mlx_lm_speed_lines(stores):
    done = run("generate", "--model", stores["int8"], "--prompt", "-", "--max-tokens", 10, stdin=QUESTION)
    assert "Paris" in done.stdout
    for line in SPEED_LINES:
        assert re.search(line, done.stdout, re.MULTILINE), done.stdout


def test_generate_streams_and_samples_with_mlx_lm_flags(stores):
    flags = ("--model", stores["int8"], "--prompt", "Once upon a time", "--ignore-chat-template", "--max-tokens", 16,
             "--temp", 0.8, "--top-p", 0.9, "--top-k", 40, "--min-p", 0.05, "--seed", 7)
    streaming = subprocess.Popen(squishlike_command("generate", *flags), stdout=subprocess.PIPE)
    try:
        head = b""
        while b"==========\n" not in head:
            chunk = os.read(streaming.stdout.fileno(), 4096)
            assert chunk, "generate exited before its output began"
            head += chunk
        if head.endswith(b"==========\n"):
            head += os.read(streaming.stdout.fileno(), 4096)
        # the first generated text arrives on its own, before the run ends with its speed lines
        assert b"Generation:" not in head
        rest, _ = streaming.communicate(timeout=600)
    finally:
        streaming.kill()
    assert streaming.returncode == 0
    streamed = (head + rest).decode().split("==========\n")[1]
    # the same flags and seed without --verbose: only the text, the same text
    quiet = run("generate", *flags, "--verbose", "False").stdout
    assert quiet.strip() == streamed.strip() and "tokens-per-sec" not in quiet


def test_generate_forced_tier_that_is_not_ready(stores):
    done = subprocess.run(squishlike_command("generate", "--model", stores["int4"], "--tier", "int4", "--prompt", "hi"),
                          capture_output=True, text=True)
    assert done.returncode == 2 and "tier 'int4' is not ready" in done.stderr


def test_chat_answers_over_stdin(stores):
    done = run("chat", "--model", stores["int8"], "--max-tokens", 10, "--system-prompt", "You are a helpful assistant.",
               stdin=f"{QUESTION}\nq\n")
    assert "Paris" in done.stdout


def test_the_seam_refuses_an_untested_mlx_lm():
    check_mlx_lm_version(mlx_lm.__version__)
    with pytest.raises(IncompatibleVersionError, match=rf"mlx_lm 0\.99\.0 is installed.*{TESTED_MLX_LM}\.x"):
        check_mlx_lm_version("0.99.0")
