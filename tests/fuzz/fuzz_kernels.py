#!/usr/bin/env python
"""Fuzz the Rust kernels (rust_quant) over shapes, dtypes, group sizes, layouts and values.

Every call gets arrays of random shape (0-D to 3-D, empty, odd, mismatched), random NumPy dtype (right or wrong),
random layout (C order, Fortran order, strided views, read-only, memory maps), random group sizes (negative, zero,
huge), random dtype names and values with NaN and inf. The contract (squishlike/quant/__init__.py): a wrong dtype
is a TypeError, anything else wrong is a QuantizationError (a ValueError). A *crash* is anything else crossing into
Python — above all a Rust panic (pyo3's PanicException) — or the process dying (a segfault, an abort).

    (cd tests && python -m fuzz.fuzz_kernels [libFuzzer flags])      e.g.  -runs=1000000  -max_total_time=600

It uses atheris for the input stream and the execution count (the kernels themselves are not instrumented:
coverage comes from the Python-side branching on the decoded structure). On success, valid calls are also checked
against the NumPy reference (squishlike.quant.reference), so the fuzzer also guards bit-exactness.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris
import numpy as np

with atheris.instrument_imports(include=["squishlike.quant"]):
    import squishlike.quant as q
    from squishlike.quant import reference as ref

import rust_quant as rq  # noqa: E402
from squishlike.errors import QuantizationError  # noqa: E402

DTYPES = [np.float32, np.float16, np.uint16, np.int8, np.uint8, np.uint32, np.int32, np.float64, np.int64, np.bool_,
          np.complex64]
NAMES = ["float32", "float16", "bfloat16", "int8", "", "float64", "bf16", "float32\0", "FLOAT32"]
GROUPS = [32, 64, 128, 0, -1, 1, 3, 16, 31, 2**31, -(2**63), 2**63 - 1, 256]
BITSTREAM = [2, 3, 5, 6]  # the widths packed as mx.quantize's bitstream, in uint32 words
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e38, -1e38, 6.5e4, 1e-45]
ALLOWED = (TypeError, QuantizationError)
MMAP_DIR = Path(tempfile.mkdtemp(prefix="squishlike-fuzzk-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))

stats = {"calls": 0, "ok": 0, "typed_errors": 0, "checked_against_reference": 0}


class Decoder:
    def __init__(self, data: bytes):
        self.fdp = atheris.FuzzedDataProvider(data)

    def int(self, lo: int, hi: int) -> int:
        return self.fdp.ConsumeIntInRange(lo, hi)

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def bool(self) -> bool:
        return self.fdp.ConsumeBool()

    def shape(self, like: tuple[int, ...] | None = None) -> tuple[int, ...]:
        if like is not None and self.int(0, 3):  # mostly: the shape the call needs, sometimes off by a bit
            return tuple(max(0, d + self.pick([0, 0, 0, 1, -1, 32])) if self.int(0, 4) == 0 else d for d in like)
        ndim = self.pick([2, 2, 2, 1, 3, 0])
        return tuple(self.pick([0, 1, 2, 3, 8, 16, 31, 32, 33, 64, 96, 128, 7]) for _ in range(ndim))

    def array(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype) if self.int(0, 5) else np.dtype(self.pick(DTYPES))
        n = int(np.prod(shape)) if shape else 1
        raw = self.fdp.ConsumeBytes(min(n * dtype.itemsize, 1 << 16))
        buf = np.frombuffer(raw + bytes(n * dtype.itemsize - len(raw)), dtype=np.uint8)
        a = buf.view(dtype).reshape(shape).copy() if dtype != np.bool_ else (buf[:n] & 1).astype(bool).reshape(shape)
        if dtype.kind == "f" and a.size and self.bool():
            a.reshape(-1)[self.int(0, a.size - 1)] = self.pick(SPECIAL)
        layout = self.int(0, 9)
        if layout == 0 and a.ndim >= 2:
            a = np.asfortranarray(a)
        elif layout == 1 and a.ndim >= 1 and a.shape[-1] >= 2:
            a = a[..., ::2]  # strided view
        elif layout == 2:
            a.flags.writeable = False
        elif layout == 3 and a.size:
            path = MMAP_DIR / "m.npy"
            np.save(path, a)
            a = np.load(path, mmap_mode=self.pick(["r", "r+", "c"]))
        return a


def call(d: Decoder) -> None:
    op = d.int(0, 9)
    rows, cols = d.pick([0, 1, 2, 3, 5, 8]), d.pick([0, 2, 8, 30, 32, 33, 64, 96, 128, 7])
    group = d.pick(GROUPS)
    if op == 0:
        w = d.array(d.shape((rows, cols)), np.float32)
        name = d.pick(NAMES)
        qq, s = d.array(d.shape((rows, cols)), np.int8), d.array(d.shape((rows,)), np.float32)
        rq.quantize_int8(w, name, qq, s)
    elif op == 1:
        qq, s = d.array(d.shape((rows, cols)), np.int8), d.array(d.shape((rows,)), np.float32)
        out = d.array(d.shape((rows, cols)), np.float32)
        rq.dequantize_int8(qq, s, out, d.pick(NAMES))
    elif op in (2, 3):
        bits, word = (4, np.uint8) if op == 2 else (d.pick(BITSTREAM), np.uint32)
        w = d.array(d.shape((rows, cols)), np.float32)
        g = max(1, group) if d.int(0, 3) and 0 < group < 2**31 else group
        words = cols // 2 if bits == 4 else cols * bits // 32
        ng = cols // g if isinstance(g, int) and 0 < g < 2**31 else 1
        packed = d.array(d.shape((rows, words)), word)
        s, z = d.array(d.shape((rows, ng)), np.float32), d.array(d.shape((rows, ng)), np.float32)
        fn = getattr(rq, f"quantize_int{bits}")
        fn(w, d.pick(NAMES), g, d.pick(NAMES), d.bool(), packed, s, z)
    elif op in (4, 5):
        bits, word = (4, np.uint8) if op == 4 else (d.pick(BITSTREAM), np.uint32)
        words = cols // 2 if bits == 4 else cols * bits // 32
        ng = cols // group if 0 < group < 2**31 else 1
        packed = d.array(d.shape((rows, words)), word)
        s, z = d.array(d.shape((rows, ng)), np.float32), d.array(d.shape((rows, ng)), np.float32)
        out = d.array(d.shape((rows, cols)), np.float32)
        fn = getattr(rq, f"dequantize_int{bits}")
        fn(packed, s, z, out, group, d.pick(NAMES), d.pick(NAMES))
    elif op in (6, 7):
        bits, word = (4, np.uint8) if op == 6 else (d.pick(BITSTREAM), np.uint32)
        codes = d.array(d.shape((rows, cols)), np.uint8)
        words = cols // 2 if bits == 4 else cols * bits // 32
        packed = d.array(d.shape((rows, words)), word)
        getattr(rq, f"pack_int{bits}")(codes, packed)
        getattr(rq, f"unpack_int{bits}")(packed, d.array(d.shape((rows, cols)), np.uint8))
    else:
        # The public wrappers on well-formed input: must match the NumPy reference bit for bit.
        g = d.pick([32, 64])
        c = d.pick([64, 128])
        r = d.pick([1, 2, 3])
        w = (np.frombuffer(d.fdp.ConsumeBytes(r * c * 4).ljust(r * c * 4, b"\0"), np.float32).reshape(r, c)).copy()
        w[~np.isfinite(w)] = 0
        w = np.clip(w, -1e4, 1e4).astype(np.float32)
        if op == 8:
            got, want = q.quantize_int4(w, group_size=g), ref.quantize_int4(w, group_size=g)
        else:
            got, want = q.quantize_int8(w), ref.quantize_int8(w)
        for a, b in zip(got, want):
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                raise AssertionError(f"Rust and the NumPy reference differ (op {op}, group {g}, shape {w.shape})")
        stats["checked_against_reference"] += 1


def one_input(data: bytes) -> None:
    stats["calls"] += 1
    try:
        call(Decoder(data))
        stats["ok"] += 1
    except ALLOWED:
        stats["typed_errors"] += 1
    # Anything else — a PanicException above all — propagates and atheris reports a crash with the input.


def main() -> None:
    import atexit
    import shutil

    atexit.register(lambda: shutil.rmtree(MMAP_DIR, ignore_errors=True))
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
