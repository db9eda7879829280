"""Issue 44: a file of a store that is a link to a file outside it is refused before the file it leads to is
opened, at every entry point that reads a store: load (cold, and with verify=True), `squishlike verify` (which
exits non-zero), inspect, compress from the store, and the server's size estimate. `--sensitivity-from` is in
tests/integration/test_bpw.py and resume in test_resume.py. The kernel watches the outside (support/watch.py):
nothing there is opened, read or listed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.watch import Watch, needs_inotify

import squishlike
from squishlike.errors import SquishError

pytestmark = needs_inotify


@pytest.fixture(scope="module")
def store(tmp_path_factory, tokenizer_dir):
    from support.tiny_models import TINY_CONFIGS, make_hf_model

    root = tmp_path_factory.mktemp("links-out")
    src = make_hf_model(root / "llama", TINY_CONFIGS["llama"], tokenizer_dir)
    return squishlike.compress(src, root / "store", scheme="int4", awq=False, gptq=False, tiers=())


def linked_out(store: Path, tmp_path: Path, rel: str) -> tuple[Path, Path]:
    """A copy of `store` whose `rel` is a link to the very same file, moved outside: (the copy, the outside)."""
    copy = shutil.copytree(store, tmp_path / "model")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(copy / rel, outside / Path(rel).name)
    (copy / rel).symlink_to(outside / Path(rel).name)
    return copy, outside


PACK = "tensors/pack-00001.safetensors"


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "squishlike", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _server_estimate(model: Path, out: Path) -> None:
    from squishlike.server import expected_nbytes

    expected_nbytes(str(model))


ENTRY_POINTS = {  # what each does with the copy; a SquishError naming the link, or a return, is its answer
    "load": lambda model, out: squishlike.load(model),
    "load-verify": lambda model, out: squishlike.load(model, verify=True),
    "compress-from-the-store": lambda model, out: squishlike.compress(model, out, scheme="int8", tiers=()),
    "inspect": lambda model, out: _cli("inspect", model),
    "server-estimate": _server_estimate,
}
CASES = [(entry, PACK) for entry in ("load", "load-verify", "compress-from-the-store")] + [
    (entry, "manifest.json") for entry in ENTRY_POINTS]


@pytest.mark.parametrize("entry, rel", CASES, ids=[f"{e}-{r.split('/')[-1]}" for e, r in CASES])
def test_a_link_out_of_the_store_is_refused_before_it_is_opened(store, tmp_path, entry, rel):
    model, outside = linked_out(store, tmp_path, rel)
    watch = Watch(outside)
    try:
        ENTRY_POINTS[entry](model, tmp_path / "out")
    except SquishError as e:
        assert str(model / rel) in str(e) or str(model) in str(e), e
    assert watch.events() == []  # nothing outside opened, read or listed
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rel", [PACK, "manifest.json", "config.json"])
def test_verify_exits_non_zero_on_a_link_out_of_the_store_without_opening_it(store, tmp_path, rel):
    model, outside = linked_out(store, tmp_path, rel)
    watch = Watch(outside)
    run = _cli("verify", model)
    assert run.returncode != 0, run.stdout
    assert rel.split("/")[-1] in run.stdout + run.stderr
    assert watch.events() == []
