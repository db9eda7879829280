"""The `squishlike` command: real subprocesses, real files; usage errors exit 2 and leave nothing that looks done."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

import squishlike
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
    for command in ("compress", "generate", "chat", "server", "inspect", "verify", "export", "eval", "bench", "demo"):
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
    assert NpyDir(store).manifest.scheme == "int8"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("fmt,group", [("int4", 48), ("int3", 128), ("int8", 7)])
def test_bad_group_size(tiny_llama, tmp_path, fmt, group):
    done = cli("compress", tiny_llama, "-o", tmp_path / "out", "--format", fmt, "--group-size", group, check_rc=2)
    assert f"group size {group}" in done.stderr
    assert not (tmp_path / "out").exists()


def test_forced_tier_not_ready(tiny_llama, tmp_path):
    squishlike.compress(tiny_llama, tmp_path / "out", format="int8")
    done = cli("generate", "--model", tmp_path / "out", "--prompt", "hi", "--tier", "finalized", check_rc=2)
    assert "tier 'finalized' is not ready" in done.stderr


def test_inspect_and_verify(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "out", format="int4")
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
