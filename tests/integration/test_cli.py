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
from squishlike.errors import TierNotReadyError, UnknownOptionError
from squishlike.npydir import NpyDir, is_npydir
from squishlike.tiers.order import reason


def cli(*args, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "squishlike", *map(str, args)], capture_output=True, text=True)
    if check_rc is not None:
        assert done.returncode == check_rc, done.stderr
    return done


def looks_complete(path) -> bool:
    return is_npydir(path)


def test_help_explains_every_command():
    out = cli("--help").stdout
    for command in ("compress", "generate", "chat", "server", "inspect", "verify", "export", "eval", "bench", "demo",
                    "prune"):
        assert command in out
    assert "--group-size" in cli("compress", "--help").stdout
    assert "--prompt-concurrency" in cli("server", "--help").stdout  # mlx_lm.server's own flags
    for tool in ("generate", "chat", "server"):  # a tool's help: mlx_lm's flags, then squishlike's own
        done = cli(tool, "--help")
        assert done.returncode == 0 and "--max-tokens" in done.stdout, done.stderr
        assert done.stdout.index("--max-tokens") < done.stdout.index("squishlike's options") < done.stdout.index(
            "--tier")
    assert "--pipeline" in cli("generate", "--help").stdout


def test_version():
    assert cli("--version").stdout.strip() == f"squishlike {squishlike.__version__}"


def test_public_api_names_and_signature(tmp_path):
    assert dir(squishlike) == sorted(["load", "sharded_load", "compress", "open_weights", "export", "errors",
                                      "__version__"])
    assert sorted(squishlike.__all__) == dir(squishlike)
    for name in squishlike.__all__:
        assert getattr(squishlike, name) is not None
    assert squishlike.errors.SquishError.__module__ == "squishlike.errors"
    options = inspect.signature(squishlike.compress).parameters
    assert options["group_size"].default == 64 and options["scheme"].kind is inspect.Parameter.KEYWORD_ONLY
    assert options["format"].default is None  # the old name of scheme, deprecated
    for name in options:
        if name not in ("src", "out"):
            assert f"- {name}:" in squishlike.compress.__doc__, f"option {name} is not documented"
    with pytest.raises(TypeError, match="fromat") as typo:
        squishlike.compress(tmp_path / "src", tmp_path / "out", fromat="int4")
    assert isinstance(typo.value, UnknownOptionError)
    assert "did you mean 'format'?" in str(typo.value) and "group_size, passthrough" in str(typo.value)
    assert not (tmp_path / "out").exists()


def test_format_is_the_deprecated_name_of_scheme(tiny_llama, tmp_path):
    """compress(format=...) still works, warns that the quantization scheme is now `scheme=`, and writes the store
    scheme= writes."""
    fast = {"awq": False, "gptq": False, "tiers": ()}
    with pytest.warns(DeprecationWarning, match=r"compress\(scheme=\.\.\.\)") as caught:
        old = squishlike.compress(tiny_llama, tmp_path / "old", format="int4", **fast)
    assert caught[0].filename == __file__  # it points at the caller's line
    new = squishlike.compress(tiny_llama, tmp_path / "new", scheme="int4", **fast)
    assert NpyDir(old).manifest.scheme == NpyDir(new).manifest.scheme == "int4"
    assert {n: e.files for n, e in NpyDir(old).entries.items()} == {n: e.files for n, e in NpyDir(new).entries.items()}


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
    for force in ((), ("--force",)):  # from the first refusal on, a non-store is said never to be replaced
        done = cli("compress", tiny_llama, "-o", out, *force, check_rc=2)
        assert "not a squishlike npy-dir; compress never replaces it, even with --force" in done.stderr
    assert (out / "precious.txt").read_text() == "keep me"

    store = tmp_path / "store"
    cli("compress", tiny_llama, "-o", store, "--scheme", "int4")
    done = cli("compress", tiny_llama, "-o", store, "--scheme", "int8", check_rc=2)
    assert "exists and holds an npy-dir; pass --force to replace it" in done.stderr
    cli("compress", tiny_llama, "-o", store, "--scheme", "int8", "--force")
    assert NpyDir(store).manifest.scheme == "int8g"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("fmt,group", [("int4", 48), ("int3", 128), ("int8", 7), ("int4", "row"), ("int8", "rows")])
def test_bad_group_size(tiny_llama, tmp_path, fmt, group):
    done = cli("compress", tiny_llama, "-o", tmp_path / "out", "--scheme", fmt, "--group-size", group, check_rc=2)
    error = done.stderr.splitlines()[-1]  # "rows" is refused by the flag's own parser, the rest by compress
    assert error.startswith("squishlike compress: error: ") and f"group-size{':' if group == 'rows' else ''} " in error
    if group != "rows":
        assert error.startswith(f"squishlike compress: error: --group-size {group} is not valid for {fmt}")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=f"^group_size={group} is not valid for {fmt}; choose one of"):
        squishlike.compress(tiny_llama, tmp_path / "out", scheme=fmt, group_size=group)  # the API names its own


def test_forced_tier_not_ready(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8")
    done = cli("generate", "--model", out, "--prompt", "hi", "--tier", "finalized", check_rc=2)
    assert done.stderr.startswith(f"squishlike generate: error: {out}: tier 'finalized' is not ready "
                                  "(finalized/.ready: absent); "
                                  "ready: cold; compress again with finalized in --tiers and a first load builds it")
    squishlike.load(out, tier="mlx")  # a tier of the policy, built on demand
    with pytest.raises(TierNotReadyError) as missing:
        squishlike.load(out, tier="int3")
    assert str(missing.value) == (f"{out}: tier 'int3' is not ready (.squish_3bit_ready: absent); ready: mlx, "
                                  "cold; only an int3 store has one: compress with scheme=int3")


def test_inspect_and_verify(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4", tiers=("int4", "mlx"))
    squishlike.load(out)
    report = json.loads(cli("inspect", out, "--json").stdout)
    assert report["format"] == "npydir"
    assert report["tiers"]["int4"]["state"] == "ready" and report["tiers"]["finalized"]["state"] == "absent"
    assert report["quality"]["layers.0.ffn.up.weight"]["rel_error"] > 0
    assert f"load takes    {report['load']['tier']}: " in cli("inspect", out).stdout
    assert cli("verify", out).stdout.strip() == f"{out}: OK (npydir format 2: checked the checksum of every file of the " \
                                                "store and of each ready tier and rank share)"

    victim = next((out / "tensors").glob("pack-*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    done = cli("verify", out, check_rc=1)
    assert victim.name in done.stdout


def test_inspect_says_which_tier_load_takes_and_why(tiny_llama, tmp_path):
    default = squishlike.compress(tiny_llama, tmp_path / "default", scheme="int4")
    squishlike.load(default)  # the int4 tier is read from the store: nothing is built
    report = json.loads(cli("inspect", default, "--json").stdout)
    assert report["load"]["tier"] == "int4" and "read straight from the store" in report["load"]["reason"]
    out = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4", tiers=("mlx", "finalized"))
    report = json.loads(cli("inspect", out, "--json").stdout)
    assert report["load"]["tier"] == "cold" and "this load builds tier mlx" in report["load"]["reason"]
    squishlike.load(out)
    report = json.loads(cli("inspect", out, "--json").stdout)
    assert list(report["tiers"]) == ["int4", "int8", "int3", "mlx", "finalized"]  # this device's order
    assert report["load"]["tier"] == "mlx" and reason() in report["load"]["reason"]
    assert report["tiers"]["mlx"]["bytes"] == (out / "squish_weights.safetensors").stat().st_size
    assert report["tiers"]["int4"] == {"state": "absent", "bytes": 0, "wanted": False}
    assert "load takes    mlx: the first ready tier" in cli("inspect", out).stdout


def test_prune_removes_caches_under_the_lock_and_keeps_the_store(tiny_llama, tmp_path):
    out = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4", tiers=("mlx", "finalized", "int4"))
    reference, _ = squishlike.load(out)
    store_files = {p: p.read_bytes() for p in (out / "tensors").iterdir()}
    int4_bytes = (out / "squish_4bit" / "model.safetensors").stat().st_size

    done = cli("prune", out)  # default: keep only the tier load takes here (int4, built: the policy names it)
    assert "removed tier finalized" in done.stdout and "removed tier mlx" in done.stdout and "kept int4" in done.stdout
    assert not (out / "finalized").exists() and not (out / "squish_weights.safetensors").exists()
    assert (out / "squish_4bit" / "model.safetensors").stat().st_size == int4_bytes

    bad = cli("prune", out, "--keep", "fast", check_rc=2)
    assert "unknown tier fast" in bad.stderr and (out / "squish_4bit").exists()

    with DirectoryLock(out):  # a load building a tier holds the lock: prune waits for it
        waiting = subprocess.Popen([sys.executable, "-m", "squishlike", "prune", str(out), "--keep", ""],
                                   stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=3)
        assert (out / "squish_4bit").exists()
    assert waiting.wait(timeout=60) == 0 and "removed tier int4" in waiting.stdout.read()
    assert not (out / "squish_4bit").exists() and not (out / ".squish_4bit_ready").exists()
    assert {p: p.read_bytes() for p in (out / "tensors").iterdir()} == store_files
    assert json.loads(cli("verify", out, "--json").stdout)["problems"] == []
    again, _ = squishlike.load(out)  # cold, and the tiers the policy names are built again
    assert_same_weights(reference, again)
    assert (out / ".squish_4bit_ready").exists()


def test_compress_says_what_it_did_on_stdout_and_json(tiny_llama, tmp_path):
    done = cli("compress", tiny_llama, "-o", tmp_path / "int4", "--format", "int4")  # --scheme's earlier name
    store_bytes = sum(r.size for r in NpyDir(tmp_path / "int4").part_files().values())
    assert done.stdout.startswith(f"{tmp_path / 'int4'}: the INT4 store is ")
    assert "x smaller than the float32 source" in done.stdout and done.stdout.count("\n") == 1
    assert "compressed" not in done.stderr  # stderr is for progress only

    # A store bigger than its source says so in words: INT8 of an MLX 4-bit model.
    cli("export", tiny_llama, "--to", "mlx", "-o", tmp_path / "mlx4", "-q")
    done = cli("compress", tmp_path / "mlx4", "-o", tmp_path / "int8", "--json")
    report = json.loads(done.stdout)
    assert report["store_bytes"] == sum(r.size for r in NpyDir(tmp_path / "int8").part_files().values())
    assert report["store_bytes"] > report["source_bytes"] and report["path"] == str(tmp_path / "int8")
    assert report["scheme"] == "int8" and report["tiers"][0] == "mlx" and report["tensors"] > report["quantized"] > 0
    ratio = report["store_bytes"] / report["source_bytes"]
    assert store_bytes > 0
    done = cli("compress", tmp_path / "mlx4", "-o", tmp_path / "int8", "--force")
    assert f"the INT8 store is {ratio:.1f}x the size of the {report['source_dtype']} source" in done.stdout


@pytest.mark.parametrize("fmt,tiers,problem", [
    ("int4", "int3", "tier int3 is built only from a store holding int3 tensors and this one is --scheme int4 with "
                     "no --bits rule of that width; leave int3 out of --tiers, compress with --scheme int3, or give a "
                     "--bits rule of its width"),
    ("int8", "mlx,int4", "tier int4 is built only from a store holding int4 tensors and this one is --scheme int8"),
    ("int8", "", "argument --tiers: names no tier"),
    ("int8", "mlx,fast", "--tiers names unknown tier(s) fast"),
])
def test_impossible_tiers_are_refused(tiny_llama, tmp_path, fmt, tiers, problem):
    done = cli("compress", tiny_llama, "-o", tmp_path / "out", "--scheme", fmt, "--tiers", tiers, check_rc=2)
    assert done.stderr.splitlines()[-1].startswith("squishlike compress: error: ") and problem in done.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_no_lock_file_is_left_beside_the_output(tiny_llama, tmp_path):
    import os

    cli("compress", tiny_llama, "-o", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "out"]
    # Interrupted (a real SIGINT, as Ctrl-C) while it holds the lock: nothing is left, the lock file included.
    env = {**os.environ, "SQUISHLIKE_FAULT_AT": "lock:*", "SQUISHLIKE_FAULT_ACTION": "sigint"}
    done = subprocess.run([sys.executable, "-m", "squishlike", "compress", str(tiny_llama), "-o",
                           str(tmp_path / "again")], capture_output=True, text=True, env=env)
    assert done.returncode == 130 and "interrupted" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "out"]


def test_help_shows_every_default():
    from squishlike.cli import build_parser

    parser = build_parser()
    for name, command in parser._subparsers._group_actions[0].choices.items():
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if action.default not in (None, False, (), "==SUPPRESS==") and action.option_strings:
                shown = "default" in (action.help or "") or f"(default: {action.default})" in text
                assert shown, f"{name} {action.option_strings[-1]}: default {action.default!r} not shown"
    text = " ".join(cli("compress", "--help").stdout.split())
    assert "(default: int8;" in text and "(default: 0.08)" in text


def test_the_parser_does_not_import_mlx_lm():
    """The CLI builds its parser before it re-executes itself with OpenBLAS (compress, eval): what that imports, the
    command pays twice. mlx_lm and transformers are most of a second."""
    code = ("import sys; from squishlike.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_errors_have_one_form(tiny_llama, tmp_path):
    for argv in (["compress", tiny_llama], ["compress", tmp_path / "nope", "-o", tmp_path / "out"],
                 ["inspect", tmp_path / "nope"], ["verify", tmp_path / "nope"]):
        done = cli(*argv, check_rc=2)
        assert done.stderr.splitlines()[-1].startswith(f"squishlike {argv[0]}: error: "), done.stderr


def test_inspect_summary_first_and_fitted_to_the_terminal(tiny_llama, tmp_path):
    import os

    out = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4", tiers=("mlx",))
    squishlike.load(out)
    report = json.loads(cli("inspect", out, "--json").stdout)
    served = report["load"]["tier"]
    for columns in (60, 120):
        env = {**os.environ, "COLUMNS": str(columns)}
        text = subprocess.run([sys.executable, "-m", "squishlike", "inspect", str(out)], capture_output=True,
                              text=True, env=env, check=True).stdout
        lines = text.splitlines()
        assert lines[0] == str(out) and lines[1] == "  format        npydir format 2: INT4 store, runtime float32"
        assert lines[2].startswith("  architecture  llama: ") and lines[3].startswith("  size          ")
        assert f"load takes    {served}: {report['load']['reason']}" in text
        size = f"{report['tiers'][served]['bytes'] / 1e6:.1f}"
        assert lines[4].startswith("  tiers ")  # one row a tier, in this device's order, after the label column
        assert any(line[16:].split()[:3] == [served, size, "MB"] for line in lines[4:10])
        table = lines[lines.index("") + 1:]
        assert table[0].split()[:4] == ["tensor", "dtype", "shape", "size"]
        rows = [line.split()[0] for line in table[1:] if not line.startswith(" ")]  # the rest: wrapped notes
        assert sorted(rows) == sorted(NpyDir(out).entries)  # every name whole, however narrow the terminal
        assert columns < 100 or max(map(len, table)) <= columns
    assert served != "cold" and report["tiers"][served]["state"] == "ready" and report["architecture"] == "llama"
    assert report["bytes"] == sum(t["nbytes"] for t in report["tensors"]) > 0
    assert all(t["source"] and t["canonical"] in report["quality"] for t in report["tensors"])


def test_verify_what_each_format_allows(tiny_llama, tmp_path):
    from support.fixtures.gguf_models import random_model, write_gguf

    _, config, weights = random_model("llama")
    gguf_file = write_gguf(tmp_path / "tiny.gguf", config, weights)
    done = cli("verify", gguf_file)
    assert done.stdout.strip() == f"{gguf_file}: OK (gguf: no checksums in this format; checked the headers and " \
                                  "that every tensor reads)"
    report = json.loads(cli("verify", tiny_llama, "--json").stdout)
    assert report["format"] == "hf" and report["ok"] and report["problems"] == []
    assert "no checksums" in report["checked"]

    with open(gguf_file, "r+b") as f:  # a tensor's bytes cut off: the structure no longer holds
        f.truncate(gguf_file.stat().st_size - 4096)
    done = cli("verify", gguf_file, check_rc=1)
    assert str(gguf_file) in done.stdout and "problem" in done.stdout

    shard = tiny_llama / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    report = json.loads(cli("verify", tiny_llama, "--json", check_rc=1).stdout)
    assert not report["ok"] and any("model.safetensors" in p for p in report["problems"])


def test_ollama_store_read_back_by_its_path(tiny_llama, tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "OLLAMA_MODELS"}
    report = json.loads(cli("export", tiny_llama, "--to", "ollama", "-o", tmp_path / "store", "--ollama-name",
                            "tiny:f32", "--json").stdout)
    manifest = tmp_path / "store" / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "f32"
    assert report["output"] == str(manifest)
    for path in (tmp_path / "store", tmp_path / "store" / "tiny:f32", tmp_path / "store" / "tiny:f32"):
        done = subprocess.run([sys.executable, "-m", "squishlike", "inspect", str(path), "--json"],
                              capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["format"] == "ollama"
    report = json.loads(cli("verify", tmp_path / "store", "--json").stdout)
    assert report["ok"] and "sha256 digest of every blob" in report["checked"]
    blob = max((tmp_path / "store" / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    report = json.loads(cli("verify", tmp_path / "store", "--json", check_rc=1).stdout)
    assert len(report["problems"]) == 1 and blob.name in report["problems"][0]

    cli("export", tiny_llama, "--to", "ollama", "-o", tmp_path / "store", "--ollama-name", "other:f32")
    done = cli("inspect", tmp_path / "store", check_rc=2)
    assert "holds 2 models (other:f32, tiny:f32)" in done.stderr


def test_export_dtype(tiny_llama, tmp_path):
    import mlx.core as mx

    report = json.loads(cli("export", tiny_llama, "--to", "mlx", "-o", tmp_path / "mlx", "--dtype", "bfloat16",
                            "--json").stdout)
    assert report["dtype"] == "bfloat16" and report["output"] == str(tmp_path / "mlx")
    weights = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.bfloat16}
    assert json.loads((tmp_path / "mlx" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    source = mx.load(str(tiny_llama / "model.safetensors"))
    name = next(n for n in source if n.endswith("up_proj.weight"))
    assert mx.array_equal(weights[name], source[name].astype(mx.bfloat16)).item()


@pytest.mark.parametrize("flags,restarts", [
    (["--scheme", "int4"], True),  # calibrated by default
    (["--scheme", "int4", "--no-awq", "--no-gptq"], False),  # every calibration switched off
    (["--scheme", "int4", "--no-awq", "--no-gptq", "--mixed-precision", "0.1"], True),
    (["--scheme", "int8"], False),
    (["--scheme", "int8", "--awq"], True),
    (["--scheme", "int3"], True),  # the accuracy gate runs the model
])
def test_compress_restarts_with_openblas_only_when_it_runs_the_model(flags, restarts):
    from squishlike.cli import build_parser

    args = build_parser().parse_args(["compress", "model", "-o", "out", *flags])
    assert args.fast_blas(args) is restarts
