"""The file hashes (squishlike/io/checksum.py) and the Rust XXH3-128 behind the fast one. The reference vectors are
pinned by the crate's own tests (`cargo test`, rust_quant/src/hash.rs); here: the binding streams, takes what
Python hands it, and which hash each check compares."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from rust_quant import Xxh3

from squishlike.io.checksum import CHECKSUM, FAST, HASHES, Digests, file_problem, file_record, hashes_to_check


def xxh3(*chunks) -> str:
    h = Xxh3()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


DATA = np.random.default_rng(0).integers(0, 256, 1_000_003, dtype=np.uint8).tobytes()


def test_xxh3_of_nothing_is_the_reference_value():
    assert xxh3() == xxh3(b"") == "99aa06d3014798d86001c324468d497f"


@pytest.mark.parametrize("chunk", [1, 63, 256, 4096, 65537, len(DATA)])
def test_xxh3_in_chunks_equals_whole(chunk):
    view = memoryview(DATA)
    whole = xxh3(DATA)
    assert xxh3(*(view[i:i + chunk] for i in range(0, len(DATA), chunk))) == whole


def test_xxh3_takes_any_contiguous_bytes():
    array = np.frombuffer(DATA[:4000], np.uint8)
    whole = xxh3(DATA[:4000])
    for same in (bytearray(DATA[:4000]), memoryview(DATA)[:4000], array, array.view(np.float32).reshape(10, 100)):
        assert xxh3(same) == whole
    with pytest.raises(ValueError):
        xxh3(array[::2])
    with pytest.raises(TypeError):
        xxh3("text")


def test_different_data_gives_different_digests():
    damaged = bytearray(DATA)
    damaged[500_000] ^= 1
    digests = {xxh3(DATA), xxh3(damaged), xxh3(DATA[:-1]), xxh3(DATA + b"\0")}
    assert len(digests) == 4 and all(len(d) == 32 and set(d) <= set("0123456789abcdef") for d in digests)


def test_digests_hash_once_into_every_record_hash():
    d = Digests()
    d.update(DATA[:1000])
    d.update(memoryview(DATA)[1000:])
    assert d.hexdigests() == {CHECKSUM: hashlib.sha256(DATA).hexdigest(), FAST: xxh3(DATA)}


def test_which_hash_each_check_compares():
    new, old = {"size": 1, CHECKSUM: "a", FAST: "b"}, {"size": 1, CHECKSUM: "a"}
    assert hashes_to_check(new) == [FAST] and hashes_to_check(old) == [CHECKSUM]
    assert hashes_to_check(new, every=True) == list(HASHES) and hashes_to_check(old, every=True) == [CHECKSUM]
    assert hashes_to_check({"size": 1}) == hashes_to_check({"size": 1}, every=True) == [CHECKSUM]


def test_file_problem_names_the_hash_that_differs(tmp_path):
    path = tmp_path / "part.npy"
    path.write_bytes(DATA)
    record = file_record(path)
    assert record == {"size": len(DATA), CHECKSUM: hashlib.sha256(DATA).hexdigest(), FAST: xxh3(DATA)}
    wrong_sha = {**record, CHECKSUM: "0" * 64}
    assert file_problem(path, wrong_sha) is None  # the first load compares the fast hash only
    assert file_problem(path, wrong_sha, every=True) == "sha256 differs from the recorded checksum"
    assert file_problem(path, {**record, FAST: "0" * 32}) == "xxh3 differs from the recorded checksum"
    assert file_problem(path, {k: v for k, v in wrong_sha.items() if k != FAST}) == \
        "sha256 differs from the recorded checksum"
