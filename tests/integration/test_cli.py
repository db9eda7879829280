"""The `squishlike` command: real subprocesses, real files; usage errors exit 2 and leave nothing that looks done."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
from support.tiny_models import assert_same_weights

import squishlike
from squishlike.io.lock import DirectoryLock
from squishlike.npydir import NpyDir


def cli(*args, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "squishlike", *map(str, args)], capture_output=True, text=True)
    if check_rc is not None:
        assert done.returncode == check_rc, done.stderr
    return done


def looks_complete(path) -> bool:
    return NpyDir.is_npydir(path)


def test_help_explains_every_command():
    out = cli("--help").stdout
    for command in ("compress", "generate", "chat", "server", "inspect", "verify", "export", "eval", "bench", "demo",
                    "prune"):
        assert command in out
    assert "--group-size" in cli("compress", "--help").stdout
    assert "--prompt-concurrency" in cli("server", "--help").stdout  # mlx_lm.server's own flags


def test_version():
    assert cli("--version").stdout.strip() == f"squishlike {squishlike.__version__}"


def test_public_api_names_and_signature(tmp_path):
    assert dir(squishlike) == sorted(["load", "compress", "open_weights", "export", "errors", "__version__"])
    assert sorted(squishlike.__all__) == dir(squishlike)
    for name in squishlike.__all__:
        assert getattr(squishlike, name) is not None
    assert squishlike.errors.SquishError.__module__ == "squishlike.errors"
    options = inspect.signature(squishlike.compress).parameters
    assert options["group_size"].default == 64 and options["format"].kind is inspect.Parameter.KEYWORD_ONLY
    for name in options:
        if name not in ("src", "out"):
            assert f"- {name}:" in squishlike.compress.__doc__, f"option {name} is not documented"
    with pytest.raises(TypeError, match="fromat"):
        squishlike.compress(tmp_path / "src", tmp_path / "out", fromat="int4")
    assert not (tmp_path / "out").exists()


def test_missing_source(tmp_path):
    done = cli("compress", tmp_path / "nope", "-o", tmp_path / "out", check_rc=2)
    assert "nope" in done.stderr and "no such" in done.stderr.lower()
    assert not (tmp_path / "out").exists()


def test_unknown_source_format(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    done = cli("compress", tmp_path / "junk", "-o", tmp_path / "out", check_rc=2)
    assert "junk" in done.stderr and "not a model" in done.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_model_type(tiny_llama, tmp_path):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (tiny_llama / "config.json").write_text(json.dumps(config))
    done = cli("compress", tiny_llama, "-o", tmp_path / "out", check_rc=2)
    assert "no_such_arch" in done.stderr
    assert not looks_complete(tmp_path / "out")


def test_output_exists_and_force(tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    done = cli("compress", tiny_llama, "-o", out, check_rc=2)
    assert "exists" in done.stderr and "--force" in done.stderr
    done = cli("compress", tiny_llama, "-o", out, "--force", check_rc=2)
    assert "not a squishlike npy-dir" in done.stderr
    assert (out / "precious.txt").read_text() == "keep me"

    store = tmp_path / "store"
    cli("compress", tiny_llama, "-o", store, "--format", "int4")
    cli("compress", tiny_llama, "-o", store, "--format", "int8", "--force")
    assert NpyDir(store).manifest.scheme == "int8g"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("fmt,group", [("int4", 48), ("int3", 128), ("int8", 7), ("int4", "row"), ("int8", "rows")])
def test_bad_group_size(tiny_llama, tmp_path, fmt, group):
    done = cli("compress", tiny_llama, "-o", tmp_path / "out", "--format", fmt, "--group-size", group, check_rc=2)
    assert f"group size {group}" in done.stderr
    assert not (tmp_path / "out").exists()


def test_forced_tier_not_ready(tiny_llama, tmp_path):
    squishlike.compress(tiny_llama, tmp_path / "out", format="int8")
    done = cli("generate", "--model", tmp_path / "out", "--prompt", "hi", "--tier", "finalized", check_rc=2)
    assert "tier 'finalized' is not ready" in done.stderr


def test_inspect_and_verify(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "out", format="int4", tiers=("int4", "mlx"))
    squishlike.load(out)
    report = json.loads(cli("inspect", out, "--json").stdout)
    assert report["format"] == "npydir"
    assert report["tiers"]["int4"]["state"] == "ready" and report["tiers"]["finalized"]["state"] == "absent"
    assert report["quality"]["layers.0.ffn.up.weight"]["rel_error"] > 0
    assert "tier int4" in cli("inspect", out).stdout
    assert cli("verify", out).stdout.strip().endswith("OK")

    victim = next((out / "tensors").glob("*__q4.npy"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    done = cli("verify", out, check_rc=1)
    assert victim.name in done.stdout


def test_inspect_says_which_tier_load_takes_and_why(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "out", format="int4")
    report = json.loads(cli("inspect", out, "--json").stdout)
    assert report["load"]["tier"] == "cold" and "this load builds tier mlx" in report["load"]["reason"]
    squishlike.load(out)
    report = json.loads(cli("inspect", out, "--json").stdout)
    assert list(report["tiers"]) == ["mlx", "finalized", "int4", "int8", "int3"]  # this (cpu) device's order
    assert report["load"]["tier"] == "mlx" and "quantized matmul is slow on mlx[cpu]" in report["load"]["reason"]
    assert report["tiers"]["mlx"]["bytes"] == (out / "squish_weights.safetensors").stat().st_size
    assert report["tiers"]["int4"] == {"state": "absent", "bytes": 0, "wanted": True}
    assert "load takes tier mlx: the first ready tier" in cli("inspect", out).stdout


def test_prune_removes_caches_under_the_lock_and_keeps_the_store(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "out", format="int4", tiers=("mlx", "finalized", "int4"))
    reference, _ = squishlike.load(out)
    store_files = {p: p.read_bytes() for p in (out / "tensors").iterdir()}
    mlx_bytes = (out / "squish_weights.safetensors").stat().st_size

    done = cli("prune", out)  # default: keep only the tier load takes here (mlx on cpu)
    assert "removed tier finalized" in done.stdout and "removed tier int4" in done.stdout and "kept mlx" in done.stdout
    assert not (out / "finalized").exists() and not (out / "squish_4bit").exists()
    assert (out / "squish_weights.safetensors").stat().st_size == mlx_bytes

    bad = cli("prune", out, "--keep", "fast", check_rc=2)
    assert "unknown tier fast" in bad.stderr and (out / "squish_weights.safetensors").exists()

    with DirectoryLock(out):  # a load building a tier holds the lock: prune waits for it
        waiting = subprocess.Popen([sys.executable, "-m", "squishlike", "prune", str(out), "--keep", ""],
                                   stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=3)
        assert (out / "squish_weights.safetensors").exists()
    assert waiting.wait(timeout=60) == 0 and "removed tier mlx" in waiting.stdout.read()
    assert not (out / "squish_weights.safetensors").exists() and not (out / ".squish_ready").exists()
    assert {p: p.read_bytes() for p in (out / "tensors").iterdir()} == store_files
    assert cli("verify", out).stdout.strip().endswith("OK")
    again, _ = squishlike.load(out)  # cold, and the tier the order uses is built again
    assert_same_weights(reference, again)
    assert (out / ".squish_ready").exists()
