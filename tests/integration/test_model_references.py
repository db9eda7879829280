"""What a model reference can be, as for mlx_lm.load: a path, or a Hugging Face repo id found in (or fetched into)
the local cache; and what cannot be loaded fails with an error naming the model and saying why in mlx_lm's words.

The Hugging Face cache here is either a fake one with the hub's real layout (models--ORG--NAME/refs/main,
snapshots/<rev>/...) under HF_HUB_CACHE, in processes with HF_HUB_OFFLINE=1, or one that huggingface_hub's real
download fills from a fake Hub on 127.0.0.1 (tests/support/fake_hub.py): nothing touches the network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.fake_hub import FakeHub

import squishlike
from squishlike.errors import UnknownFormatError, UnsupportedArchitectureError
from squishlike.npydir import NpyDir

REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo: str, files: Path) -> Path:
    """Put `files` into the hub cache at `cache` as the main revision of `repo`; the snapshot directory."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / REVISION
    shutil.copytree(files, snapshot)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    return snapshot


def python(env: dict[str, str], *argv: object, rc: int = 0) -> subprocess.CompletedProcess:
    """`python ARGV` with `env` added to this process's environment."""
    done = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    assert done.returncode == rc, done.stderr
    return done


def offline(cache: Path, *argv: object, rc: int = 0) -> subprocess.CompletedProcess:
    """`python ARGV` with HF_HUB_CACHE=cache and HF_HUB_OFFLINE=1."""
    return python({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}, *argv, rc=rc)


def from_hub(hub: FakeHub, cache: Path, *argv: object, rc: int = 0) -> subprocess.CompletedProcess:
    """`python ARGV` online, with `hub` as the Hugging Face Hub and HF_HUB_CACHE=cache. A subprocess, because
    huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE once, at import."""
    return python({"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(cache),
                   "HF_HOME": str(cache.parent / "hf-home"),  # no token or settings of this machine's user
                   "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"},  # a configured proxy must not see it
                  *argv, rc=rc)


SAME_AS_MLX_LM = """
import sys
import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
import squishlike

ours, _ = squishlike.load(sys.argv[1])
theirs, _ = mlx_lm.load(sys.argv[1])
ours, theirs = dict(tree_flatten(ours.parameters())), dict(tree_flatten(theirs.parameters()))
assert ours.keys() == theirs.keys()
assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
print(len(ours), "parameters as mlx_lm.load's")
"""


def test_a_cached_repo_id_works_offline_everywhere_a_path_does(tiny_llama, tmp_path):
    cache = tmp_path / "hub"
    snapshot = cache_repo(cache, "tiny-org/tiny-llama", tiny_llama)
    cache_repo(cache, "tiny-org/tiny-llama-int8", squishlike.compress(tiny_llama, tmp_path / "int8", scheme="int8"))

    assert "parameters as mlx_lm.load's" in offline(cache, "-c", SAME_AS_MLX_LM, "tiny-org/tiny-llama").stdout
    offline(cache, "-m", "squishlike", "compress", "tiny-org/tiny-llama", "-o", tmp_path / "out")
    assert NpyDir(tmp_path / "out").manifest.source.path == str(snapshot)
    report = json.loads(offline(cache, "-m", "squishlike", "inspect", "tiny-org/tiny-llama-int8", "--json").stdout)
    assert report["format"] == "npydir" and "tiers" in report
    verified = offline(cache, "-m", "squishlike", "verify", "tiny-org/tiny-llama-int8", "--json").stdout
    assert json.loads(verified)["problems"] == []
    offline(cache, "-m", "squishlike", "export", "tiny-org/tiny-llama-int8", "--to", "hf", "-o", tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    done = offline(cache, "-m", "squishlike", "generate", "--model", "tiny-org/tiny-llama-int8", "--prompt", "hi",
                   "--max-tokens", 2)
    assert "Prompt:" in done.stdout


def test_offline_and_not_cached_says_so_and_how_to_fetch_it(tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()
    out = tmp_path / "out"
    for command in (("compress", "tiny-org/absent", "-o", out), ("inspect", "tiny-org/absent"),
                    ("verify", "tiny-org/absent"), ("export", "tiny-org/absent", "--to", "hf", "-o", out),
                    ("generate", "--model", "tiny-org/absent")):
        error = offline(cache, "-m", "squishlike", *command, rc=2).stderr
        assert "tiny-org/absent: no such file or directory" in error, command
        assert "not in the local cache" in error and "HF_HUB_OFFLINE is set" in error
        assert "`huggingface-cli download tiny-org/absent`" in error and "unset HF_HUB_OFFLINE" in error
        assert "Traceback" not in error
    assert not out.exists() and list(cache.iterdir()) == []


def test_a_repo_id_not_in_the_cache_is_downloaded_as_mlx_lm_downloads_it(fake_hub, tiny_llama, tmp_path):
    (tiny_llama / "README.md").write_text("not a file mlx_lm's download asks for")
    commit = fake_hub.add("test-org/tiny", tiny_llama)
    cache = tmp_path / "hub"

    loaded = from_hub(fake_hub, cache, "-c", SAME_AS_MLX_LM, "test-org/tiny")
    assert "parameters as mlx_lm.load's" in loaded.stdout
    snapshot = cache / "models--test-org--tiny" / "snapshots" / commit
    fetched = sorted(f.name for f in tiny_llama.iterdir() if f.name != "README.md")
    assert sorted(f.name for f in snapshot.iterdir()) == fetched
    assert (cache / "models--test-org--tiny" / "refs" / "main").read_text() == commit
    assert "GET /api/models/test-org/tiny/revision/main" in fake_hub.requests
    for name in fetched:
        assert f"GET /test-org/tiny/resolve/{commit}/{name}" in fake_hub.requests
    assert not any("README.md" in request for request in fake_hub.requests)

    from_hub(fake_hub, cache, "-c", "import sys, squishlike; squishlike.compress(*sys.argv[1:], scheme='int4')",
             "test-org/tiny", tmp_path / "int4")
    assert NpyDir(tmp_path / "int4").manifest.source.path == str(snapshot)

    asked = len(fake_hub.requests)
    report = json.loads(offline(cache, "-m", "squishlike", "inspect", "test-org/tiny", "--json").stdout)
    assert report["format"] == "hf" and report["path"] == str(snapshot)
    assert len(fake_hub.requests) == asked  # from the cache alone

    (snapshot / "model.safetensors").unlink()  # as an interrupted download leaves it
    error = offline(cache, "-m", "squishlike", "inspect", "test-org/tiny", rc=2).stderr
    assert f"test-org/tiny: the Hugging Face repo test-org/tiny is only partly in the local cache ({snapshot}" in error
    assert "HF_HUB_OFFLINE is set; complete it with `huggingface-cli download test-org/tiny`" in error


NOT_ON_THE_HUB = """
import squishlike

for repo, revision in (("test-org/tiny", "no-such-branch"), ("test-org/absent", None)):
    try:
        squishlike.load(repo, revision=revision)
    except squishlike.errors.ModelNotFoundError as e:
        print(e)
"""


def test_a_revision_or_repo_the_hub_does_not_have_is_named(fake_hub, tiny_llama, tmp_path):
    fake_hub.add("test-org/tiny", tiny_llama)
    said = from_hub(fake_hub, tmp_path / "hub", "-c", NOT_ON_THE_HUB).stdout.splitlines()
    assert said[0] == "test-org/tiny: the Hugging Face repo test-org/tiny has no revision 'no-such-branch'"
    assert said[1].startswith("test-org/absent: no such file or directory, and no Hugging Face repo test-org/absent")
    assert "GET /api/models/test-org/tiny/revision/no-such-branch" in fake_hub.requests
    assert "GET /api/models/test-org/absent/revision/main" in fake_hub.requests


def with_config(model: Path, **changes: object) -> Path:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def test_a_model_type_mlx_lm_does_not_build_is_refused_in_its_words(tiny_llama):
    said = re.escape(f"{tiny_llama}: Model type no_such_arch not supported.")
    with pytest.raises(UnsupportedArchitectureError, match=said):
        squishlike.load(with_config(tiny_llama, model_type="no_such_arch"))


def test_half_a_model_is_refused_in_mlx_lm_words(tiny_llama, tmp_path):
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for f in tiny_llama.glob("*.safetensors"):
        shutil.copy(f, weights_only)
    with pytest.raises(UnknownFormatError, match=re.escape(f"{weights_only}: config.json not found")):
        squishlike.load(weights_only)

    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_llama / "config.json", config_only)
    with pytest.raises(UnknownFormatError, match=re.escape(f"{config_only}: No safetensors found in {config_only}")):
        squishlike.load(config_only)
    assert (tiny_llama / "config.json").is_file() and any(tiny_llama.glob("*.safetensors"))  # the source untouched


def test_a_missing_local_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'nope'}: no such file or directory")):
        squishlike.load(tmp_path / "nope")
