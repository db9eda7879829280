//! Python bindings only: check every array (dtype, shape, contiguity, writeability), release the GIL, call a kernel.
//! The kernels live one file per family; the file hash (`Xxh3`) in hash.rs. Outputs are always caller-provided arrays; `squishlike.quant` is the
//! public face that allocates them when the caller passes none.
//!
//! Errors: a wrong dtype is a TypeError; anything else wrong with the input (shape, group size, NaN/inf, codes out
//! of range, a non-contiguous or read-only array) is `squishlike.errors.QuantizationError`, a ValueError.

use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};
use numpy::{Element, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

pub mod affine;
pub mod bitstream;
pub mod dtype;
pub mod finite;
pub mod gptq;
pub mod hash;
pub mod int4;
pub mod int8;
pub mod int8g;
pub mod qmv;
pub mod shape;
mod simd;

use affine::Packing;
use bitstream::{Int2, Int3, Int5, Int6};
use dtype::{Dtype, Float};
use int4::Int4;
use int8g::Int8g;

pyo3::import_exception!(squishlike.errors, QuantizationError);

fn value_error(msg: String) -> PyErr {
    QuantizationError::new_err(msg)
}

/// A value type as NumPy holds it: bfloat16 has no NumPy dtype and travels as its raw uint16 bits.
trait Stored: Float {
    type Np: Element;
    fn view(s: &[Self::Np]) -> &[Self];
    fn view_mut(s: &mut [Self::Np]) -> &mut [Self];
}

impl Stored for f32 {
    type Np = f32;
    fn view(s: &[f32]) -> &[f32] {
        s
    }
    fn view_mut(s: &mut [f32]) -> &mut [f32] {
        s
    }
}

impl Stored for f16 {
    type Np = f16;
    fn view(s: &[f16]) -> &[f16] {
        s
    }
    fn view_mut(s: &mut [f16]) -> &mut [f16] {
        s
    }
}

impl Stored for bf16 {
    type Np = u16;
    fn view(s: &[u16]) -> &[bf16] {
        s.reinterpret_cast()
    }
    fn view_mut(s: &mut [u16]) -> &mut [bf16] {
        s.reinterpret_cast_mut()
    }
}

/// Runs `$body` with `$T` bound to the Rust type of the dtype named `$name`.
macro_rules! with_dtype {
    ($name:expr, $T:ident => $body:expr) => {
        match Dtype::parse($name).map_err(value_error)? {
            Dtype::F32 => {
                type $T = f32;
                $body
            }
            Dtype::F16 => {
                type $T = f16;
                $body
            }
            Dtype::BF16 => {
                type $T = bf16;
                $body
            }
        }
    };
}

/// `a` as a C-contiguous NumPy array of T, or the error that names what is wrong.
fn array<'a, 'py, T: Element>(name: &str, a: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PyArrayDyn<T>>> {
    let arr = a.downcast::<PyArrayDyn<T>>().map_err(|_| {
        let expected = numpy::dtype::<T>(a.py());
        match a.getattr("dtype") {
            Ok(got) => PyTypeError::new_err(format!("{name} has dtype {got}; expected {expected}")),
            Err(_) => PyTypeError::new_err(format!("{name} must be a NumPy array of {expected}")),
        }
    })?;
    if !arr.is_c_contiguous() {
        return Err(value_error(format!("{name} is not C-contiguous; pass np.ascontiguousarray({name})")));
    }
    Ok(arr)
}

/// An input array, borrowed read-only (works for read-only and memory-mapped arrays, without a copy).
fn input<'py, T: Element>(name: &str, a: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    array::<T>(name, a)?.try_readonly().map_err(|e| value_error(format!("{name}: {e}")))
}

/// An output array, borrowed for writing (fails if it is read-only or overlaps an input).
fn output<'py, T: Element>(name: &str, a: &Bound<'py, PyAny>) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    array::<T>(name, a)?.try_readwrite().map_err(|e| value_error(format!("{name}: {e}")))
}

fn slice<'a, T: Element>(a: &'a PyReadonlyArrayDyn<'_, T>) -> PyResult<&'a [T]> {
    Ok(a.as_slice()?)
}

fn slice_mut<'a, T: Element>(a: &'a mut PyReadwriteArrayDyn<'_, T>) -> PyResult<&'a mut [T]> {
    Ok(a.as_slice_mut()?)
}

fn rows_cols(name: &str, shape: &[usize]) -> PyResult<(usize, usize)> {
    shape::rows_cols(name, shape).map_err(value_error)
}

fn expect(name: &str, shape: &[usize], rows: usize, cols: usize) -> PyResult<()> {
    shape::expect(name, shape, rows, cols).map_err(value_error)
}

/// A group-wise matrix's scales and biases (inputs), each checked to be [rows, groups].
fn grid_inputs<'py, S: Stored>(
    scales: &Bound<'py, PyAny>,
    biases: &Bound<'py, PyAny>,
    rows: usize,
    groups: usize,
) -> PyResult<(PyReadonlyArrayDyn<'py, S::Np>, PyReadonlyArrayDyn<'py, S::Np>)> {
    let scales = input::<S::Np>("scales", scales)?;
    expect("scales", scales.shape(), rows, groups)?;
    let biases = input::<S::Np>("biases", biases)?;
    expect("biases", biases.shape(), rows, groups)?;
    Ok((scales, biases))
}

/// A group size from Python, where a negative number must be a ValueError rather than an OverflowError.
fn positive_group(g: i64) -> PyResult<usize> {
    usize::try_from(g).map_err(|_| value_error(format!("group_size {g} must be positive")))
}

/// Per-row symmetric INT8 of `w` into `q` (int8, w's 2-D shape) and `scales` (float32, one per row).
#[pyfunction]
fn quantize_int8(
    py: Python<'_>,
    w: &Bound<'_, PyAny>,
    src_dtype: &str,
    q: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
) -> PyResult<()> {
    with_dtype!(src_dtype, W => {
        let w = input::<<W as Stored>::Np>("w", w)?;
        let (rows, cols) = rows_cols("w", w.shape())?;
        let mut q = output::<i8>("q", q)?;
        expect("q", q.shape(), rows, cols)?;
        let mut scales = output::<f32>("scales", scales)?;
        shape::expect_len("scales", scales.shape(), rows).map_err(value_error)?;
        let (w, q, scales) = (W::view(slice(&w)?), slice_mut(&mut q)?, slice_mut(&mut scales)?);
        py.allow_threads(|| int8::quantize(w, cols, q, scales)).map_err(value_error)
    })
}

/// `out` (out_dtype) = q * scale per row.
#[pyfunction]
fn dequantize_int8(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    out_dtype: &str,
) -> PyResult<()> {
    let q = input::<i8>("q", q)?;
    let (rows, cols) = rows_cols("q", q.shape())?;
    let scales = input::<f32>("scales", scales)?;
    shape::expect_len("scales", scales.shape(), rows).map_err(value_error)?;
    with_dtype!(out_dtype, O => {
        let mut out = output::<<O as Stored>::Np>("out", out)?;
        expect("out", out.shape(), rows, cols)?;
        let (q, scales, out) = (slice(&q)?, slice(&scales)?, O::view_mut(slice_mut(&mut out)?));
        py.allow_threads(|| int8::dequantize(q, scales, cols, out));
        Ok(())
    })
}

/// The index of the first NaN or infinite value of `values` (float32, float16, or bfloat16 as its uint16 bits; any
/// shape, C-contiguous), None when every value is finite.
#[pyfunction]
fn first_non_finite(py: Python<'_>, values: &Bound<'_, PyAny>, dtype: &str) -> PyResult<Option<usize>> {
    with_dtype!(dtype, T => {
        let values = input::<<T as Stored>::Np>("values", values)?;
        let values = T::view(slice(&values)?);
        Ok(py.allow_threads(|| finite::first_non_finite(values)))
    })
}

#[allow(clippy::too_many_arguments)]
fn quantize_affine<K: Packing>(
    py: Python<'_>,
    w: &Bound<'_, PyAny>,
    src_dtype: &str,
    group_size: i64,
    scale_dtype: &str,
    clip_search: bool,
    packed: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: &Bound<'_, PyAny>,
) -> PyResult<()>
where
    K::Word: Element,
{
    let group_size = positive_group(group_size)?;
    with_dtype!(src_dtype, W => with_dtype!(scale_dtype, S => {
        let w = input::<<W as Stored>::Np>("w", w)?;
        let (rows, cols) = rows_cols("w", w.shape())?;
        K::check_group(cols, group_size).map_err(value_error)?;
        let mut packed = output::<K::Word>("packed", packed)?;
        expect("packed", packed.shape(), rows, K::words(cols))?;
        let mut scales = output::<<S as Stored>::Np>("scales", scales)?;
        expect("scales", scales.shape(), rows, cols / group_size)?;
        let mut biases = output::<<S as Stored>::Np>("biases", biases)?;
        expect("biases", biases.shape(), rows, cols / group_size)?;
        let w = W::view(slice(&w)?);
        let packed = slice_mut(&mut packed)?;
        let (scales, biases) = (S::view_mut(slice_mut(&mut scales)?), S::view_mut(slice_mut(&mut biases)?));
        py.allow_threads(|| affine::quantize::<K, W, S>(w, cols, group_size, clip_search, packed, scales, biases))
            .map_err(value_error)
    }))
}

#[allow(clippy::too_many_arguments)]
fn dequantize_affine<K: Packing>(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    group_size: i64,
    scale_dtype: &str,
    out_dtype: &str,
) -> PyResult<()>
where
    K::Word: Element,
{
    let group_size = positive_group(group_size)?;
    let packed = input::<K::Word>("packed", packed)?;
    let (rows, _) = rows_cols("packed", packed.shape())?;
    with_dtype!(scale_dtype, S => with_dtype!(out_dtype, O => {
        let mut out = output::<<O as Stored>::Np>("out", out)?;
        let (_, cols) = rows_cols("out", out.shape())?;
        K::check_group(cols, group_size).map_err(value_error)?;
        expect("packed", packed.shape(), rows, K::words(cols))?;
        expect("out", out.shape(), rows, cols)?;
        let (scales, biases) = grid_inputs::<S>(scales, biases, rows, cols / group_size)?;
        let (packed, out) = (slice(&packed)?, O::view_mut(slice_mut(&mut out)?));
        let (scales, biases) = (S::view(slice(&scales)?), S::view(slice(&biases)?));
        py.allow_threads(|| affine::dequantize::<K, S, O>(packed, scales, biases, cols, group_size, out));
        Ok(())
    }))
}

fn pack_affine<K: Packing>(py: Python<'_>, q: &Bound<'_, PyAny>, packed: &Bound<'_, PyAny>) -> PyResult<()>
where
    K::Word: Element,
{
    let q = input::<u8>("q", q)?;
    let (rows, cols) = rows_cols("q", q.shape())?;
    K::check_cols(cols).map_err(value_error)?;
    let mut packed = output::<K::Word>("packed", packed)?;
    expect("packed", packed.shape(), rows, K::words(cols))?;
    let (q, packed) = (slice(&q)?, slice_mut(&mut packed)?);
    py.allow_threads(|| affine::pack::<K>(q, cols, packed)).map_err(value_error)
}

fn unpack_affine<K: Packing>(py: Python<'_>, packed: &Bound<'_, PyAny>, q: &Bound<'_, PyAny>) -> PyResult<()>
where
    K::Word: Element,
{
    let packed = input::<K::Word>("packed", packed)?;
    let mut q = output::<u8>("q", q)?;
    let (rows, cols) = rows_cols("q", q.shape())?;
    K::check_cols(cols).map_err(value_error)?;
    expect("packed", packed.shape(), rows, K::words(cols))?;
    let (packed, q) = (slice(&packed)?, slice_mut(&mut q)?);
    py.allow_threads(|| affine::unpack::<K>(packed, cols, q));
    Ok(())
}

/// The quantize and dequantize pyfunctions of one affine scheme: typed entry points over the generic
/// `quantize_affine` / `dequantize_affine`, since a #[pyfunction] cannot be generic.
macro_rules! affine_bindings {
    ($packing:ty, $quantize:ident, $quantize_doc:literal, $dequantize:ident, $dequantize_doc:literal) => {
        #[doc = $quantize_doc]
        #[pyfunction]
        #[allow(clippy::too_many_arguments)]
        fn $quantize(
            py: Python<'_>,
            w: &Bound<'_, PyAny>,
            src_dtype: &str,
            group_size: i64,
            scale_dtype: &str,
            clip_search: bool,
            packed: &Bound<'_, PyAny>,
            scales: &Bound<'_, PyAny>,
            biases: &Bound<'_, PyAny>,
        ) -> PyResult<()> {
            quantize_affine::<$packing>(py, w, src_dtype, group_size, scale_dtype, clip_search, packed, scales, biases)
        }

        #[doc = $dequantize_doc]
        #[pyfunction]
        #[allow(clippy::too_many_arguments)]
        fn $dequantize(
            py: Python<'_>,
            packed: &Bound<'_, PyAny>,
            scales: &Bound<'_, PyAny>,
            biases: &Bound<'_, PyAny>,
            out: &Bound<'_, PyAny>,
            group_size: i64,
            scale_dtype: &str,
            out_dtype: &str,
        ) -> PyResult<()> {
            dequantize_affine::<$packing>(py, packed, scales, biases, out, group_size, scale_dtype, out_dtype)
        }
    };
}

affine_bindings!(
    Int4,
    quantize_int4,
    "Affine 4-bit groups of `w` into `packed` (uint8, two codes per byte), `scales` and `biases` (scale_dtype).",
    dequantize_int4,
    "`out` (its 2-D shape gives the columns) = the INT4 codes dequantized exactly as mx.dequantize does."
);
affine_bindings!(
    Int8g,
    quantize_int8g,
    "Group-wise INT8 of `w` into `packed` (uint8, one code per byte, w's 2-D shape), `scales` and `biases`, on \
     the grid mx.quantize(bits=8) chooses.",
    dequantize_int8g,
    "`out` (its 2-D shape gives the columns) = the group-wise INT8 codes dequantized exactly as mx.dequantize does."
);
affine_bindings!(
    Int3,
    quantize_int3,
    "Affine 3-bit groups of `w` into `packed` (uint32, mx.quantize(bits=3) layout), `scales` and `biases`.",
    dequantize_int3,
    "`out` (its 2-D shape gives the columns) = the INT3 codes dequantized exactly as mx.dequantize does."
);
affine_bindings!(
    Int2,
    quantize_int2,
    "Affine 2-bit groups of `w` into `packed` (uint22, mx.quantize(bits=2) layout), `scales` and `biases`.",
    dequantize_int2,
    "`out` (its 2-D shape gives the columns) = the INT2 codes dequantized exactly as mx.dequantize does."
);
affine_bindings!(
    Int5,
    quantize_int5,
    "Affine 5-bit groups of `w` into `packed` (uint52, mx.quantize(bits=5) layout), `scales` and `biases`.",
    dequantize_int5,
    "`out` (its 2-D shape gives the columns) = the INT5 codes dequantized exactly as mx.dequantize does."
);
affine_bindings!(
    Int6,
    quantize_int6,
    "Affine 6-bit groups of `w` into `packed` (uint62, mx.quantize(bits=6) layout), `scales` and `biases`.",
    dequantize_int6,
    "`out` (its 2-D shape gives the columns) = the INT6 codes dequantized exactly as mx.dequantize does."
);

/// GPTQ's column loop over columns [start, start + group_size) of `w` (float32 [rows, cols], rewritten in place to
/// the scaled rounding errors), with `u` (float32 [group_size, group_size]) the group's block of the upper Cholesky
/// factor of the inverse Hessian: the group's codes into `q` (uint8 [rows, cols], one per byte) and its grid into
/// `scales` / `biases` (scale_dtype, [rows, cols / group_size]) for scheme int2, int3, int4, int5, int6 or
/// int8g (rust_quant/src/gptq.rs).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gptq_group(
    py: Python<'_>,
    scheme: &str,
    w: &Bound<'_, PyAny>,
    start: i64,
    group_size: i64,
    u: &Bound<'_, PyAny>,
    scale_dtype: &str,
    clip_search: bool,
    q: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let run = match scheme {
        "int4" => gptq_affine::<Int4>,
        "int3" => gptq_affine::<Int3>,
        "int8g" => gptq_affine::<Int8g>,
        "int2" => gptq_affine::<Int2>,
        "int5" => gptq_affine::<Int5>,
        "int6" => gptq_affine::<Int6>,
        _ => return Err(value_error(format!("scheme {scheme:?} has no GPTQ; use int2..int6 or int8g"))),
    };
    run(py, w, start, group_size, u, scale_dtype, clip_search, q, scales, biases)
}

#[allow(clippy::too_many_arguments)]
fn gptq_affine<K: Packing>(
    py: Python<'_>,
    w: &Bound<'_, PyAny>,
    start: i64,
    group_size: i64,
    u: &Bound<'_, PyAny>,
    scale_dtype: &str,
    clip_search: bool,
    q: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let group = positive_group(group_size)?;
    let start = usize::try_from(start).map_err(|_| value_error(format!("start {start} must not be negative")))?;
    let mut w = output::<f32>("w", w)?;
    let (rows, cols) = rows_cols("w", w.shape())?;
    K::check_group(cols, group).map_err(value_error)?;
    let u = input::<f32>("u", u)?;
    expect("u", u.shape(), group, group)?;
    let mut q = output::<u8>("q", q)?;
    expect("q", q.shape(), rows, cols)?;
    with_dtype!(scale_dtype, S => {
        let mut scales = output::<<S as Stored>::Np>("scales", scales)?;
        expect("scales", scales.shape(), rows, cols / group)?;
        let mut biases = output::<<S as Stored>::Np>("biases", biases)?;
        expect("biases", biases.shape(), rows, cols / group)?;
        let (w, u, q) = (slice_mut(&mut w)?, slice(&u)?, slice_mut(&mut q)?);
        let (scales, biases) = (S::view_mut(slice_mut(&mut scales)?), S::view_mut(slice_mut(&mut biases)?));
        py.allow_threads(|| gptq::gptq_group::<K, S>(w, cols, start, group, u, clip_search, q, scales, biases))
            .map_err(value_error)
    })
}

/// y = x @ W[experts].T row by row: x float32 [rows, cols], W the [experts * out, cols] MLX 4-bit affine matrices
/// of `words` (uint32 [experts * out, cols / 8]), `scales` and `biases` ([experts * out, cols / group_size],
/// scale_dtype), experts uint32 [rows], y float32 [rows, out] (rust_quant/src/qmv.rs).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gather_qmv_int4(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    words: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    biases: &Bound<'_, PyAny>,
    experts: &Bound<'_, PyAny>,
    y: &Bound<'_, PyAny>,
    group_size: i64,
    scale_dtype: &str,
) -> PyResult<()> {
    let group = positive_group(group_size)?;
    let x = input::<f32>("x", x)?;
    let (rows, cols) = rows_cols("x", x.shape())?;
    let experts = input::<u32>("experts", experts)?;
    shape::expect_len("experts", experts.shape(), rows).map_err(value_error)?;
    let mut y = output::<f32>("y", y)?;
    let (_, out) = rows_cols("y", y.shape())?;
    expect("y", y.shape(), rows, out)?;
    let words = input::<u32>("words", words)?;
    let (matrix_rows, _) = rows_cols("words", words.shape())?;
    if out == 0 || !matrix_rows.is_multiple_of(out) || !cols.is_multiple_of(group) {
        return Err(value_error(format!(
            "words has shape {:?}: not whole [out={out}, cols/8={}] matrices, or {cols} columns not in groups of {group}",
            words.shape(),
            cols / 8
        )));
    }
    expect("words", words.shape(), matrix_rows, cols / 8)?;
    with_dtype!(scale_dtype, S => {
        let (scales, biases) = grid_inputs::<S>(scales, biases, matrix_rows, cols / group)?;
        let (x, words, experts, y) = (slice(&x)?, slice(&words)?, slice(&experts)?, slice_mut(&mut y)?);
        let (scales, biases) = (S::view(slice(&scales)?), S::view(slice(&biases)?));
        py.allow_threads(|| qmv::gather_qmv::<S>(x, cols, words, scales, biases, group, experts, y))
            .map_err(value_error)
    })
}

/// The pack and unpack pyfunctions of one packing: codes (uint8, one per element) to the scheme's packed words and
/// back (the codes' 2-D shape gives the columns).
macro_rules! packing_bindings {
    ($packing:ty, $pack:ident, $pack_doc:literal, $unpack:ident, $unpack_doc:literal) => {
        #[doc = $pack_doc]
        #[pyfunction]
        fn $pack(py: Python<'_>, q: &Bound<'_, PyAny>, packed: &Bound<'_, PyAny>) -> PyResult<()> {
            pack_affine::<$packing>(py, q, packed)
        }

        #[doc = $unpack_doc]
        #[pyfunction]
        fn $unpack(py: Python<'_>, packed: &Bound<'_, PyAny>, q: &Bound<'_, PyAny>) -> PyResult<()> {
            unpack_affine::<$packing>(py, packed, q)
        }
    };
}

packing_bindings!(
    Int4,
    pack_int4,
    "uint8 codes 0..15 -> `packed` uint8, low nibble = even column.",
    unpack_int4,
    "Nibble-packed uint8 -> `q` uint8 codes."
);
packing_bindings!(
    Int3,
    pack_int3,
    "uint8 codes 0..7 -> `packed` uint32 in mx.quantize(bits=3)'s layout.",
    unpack_int3,
    "uint32 in mx.quantize(bits=3)'s layout -> `q` uint8 codes."
);
packing_bindings!(
    Int2,
    pack_int2,
    "uint8 codes 0..3 -> `packed` uint32 in mx.quantize(bits=2)'s layout.",
    unpack_int2,
    "uint32 in mx.quantize(bits=2)'s layout -> `q` uint8 codes."
);
packing_bindings!(
    Int5,
    pack_int5,
    "uint8 codes 0..31 -> `packed` uint32 in mx.quantize(bits=5)'s layout.",
    unpack_int5,
    "uint32 in mx.quantize(bits=5)'s layout -> `q` uint8 codes."
);
packing_bindings!(
    Int6,
    pack_int6,
    "uint8 codes 0..63 -> `packed` uint32 in mx.quantize(bits=6)'s layout.",
    unpack_int6,
    "uint32 in mx.quantize(bits=6)'s layout -> `q` uint8 codes."
);

/// One packing scheme as `squishlike.quant.schemes` reads it: its bits, the group sizes it takes, and how many
/// words of which dtype hold one block of codes (a row's packed width is cols / block * block_words).
fn scheme_constants<'py>(
    py: Python<'py>,
    bits: u32,
    group_sizes: &[usize],
    block: usize,
    block_words: usize,
    word: Bound<'py, numpy::PyArrayDescr>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bits", bits)?;
    d.set_item("group_sizes", group_sizes.to_vec())?;
    d.set_item("block", block)?;
    d.set_item("block_words", block_words)?;
    d.set_item("word", word)?;
    Ok(d)
}

fn affine_constants<K: Packing>(py: Python<'_>) -> PyResult<Bound<'_, PyDict>>
where
    K::Word: Element,
{
    let bits = (K::LEVELS as u32 + 1).trailing_zeros();
    scheme_constants(py, bits, K::GROUP_SIZES, K::BLOCK, K::words(K::BLOCK), numpy::dtype::<K::Word>(py))
}

/// Streaming XXH3-128 of a file's bytes: `update(data)` with any contiguous bytes-like object or NumPy array
/// (hashed with the GIL released, so other threads read and dequantize meanwhile), then `hexdigest()`.
#[pyclass(name = "Xxh3", module = "squishlike.rust_quant")]
#[derive(Default)]
struct PyXxh3(hash::Xxh3_128);

#[pymethods]
impl PyXxh3 {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    fn update(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = byte_view(data)?;
        let (bytes, state) = (bytes.as_slice()?, &mut self.0);
        py.allow_threads(|| state.update(bytes));
        Ok(())
    }

    fn hexdigest(&self) -> String {
        self.0.hexdigest()
    }
}

/// The bytes of `data`, without a copy: a uint8 array as it is, anything else through numpy.frombuffer (abi3 for
/// Python 3.10 has no buffer protocol of its own; frombuffer refuses memory that is not contiguous).
fn byte_view<'py>(data: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArrayDyn<'py, u8>> {
    let array = match data.downcast::<PyArrayDyn<u8>>() {
        Ok(array) => array.clone(),
        Err(_) => data.py().import("numpy")?.call_method1("frombuffer", (data, "uint8"))?.downcast_into()?,
    };
    if !array.is_c_contiguous() {
        return Err(PyValueError::new_err("Xxh3.update needs contiguous data"));
    }
    array.try_readonly().map_err(|e| PyValueError::new_err(format!("Xxh3.update: {e}")))
}

#[pymodule]
fn rust_quant(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let py = m.py();
    let schemes = PyDict::new(py);
    // INT8 is per row: no groups, one int8 word per code.
    schemes.set_item("int8", scheme_constants(py, 8, &[], 1, 1, numpy::dtype::<i8>(py))?)?;
    schemes.set_item("int8g", affine_constants::<Int8g>(py)?)?;
    schemes.set_item("int4", affine_constants::<Int4>(py)?)?;
    schemes.set_item("int3", affine_constants::<Int3>(py)?)?;
    schemes.set_item("int2", affine_constants::<Int2>(py)?)?;
    schemes.set_item("int5", affine_constants::<Int5>(py)?)?;
    schemes.set_item("int6", affine_constants::<Int6>(py)?)?;
    m.add("SCHEMES", schemes)?;
    m.add_function(wrap_pyfunction!(quantize_int8, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int8, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_int8g, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int8g, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_int4, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int4, m)?)?;
    m.add_function(wrap_pyfunction!(pack_int4, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_int4, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_int3, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int3, m)?)?;
    m.add_function(wrap_pyfunction!(pack_int3, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_int3, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_int2, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int2, m)?)?;
    m.add_function(wrap_pyfunction!(pack_int2, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_int2, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_int5, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int5, m)?)?;
    m.add_function(wrap_pyfunction!(pack_int5, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_int5, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_int6, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_int6, m)?)?;
    m.add_function(wrap_pyfunction!(pack_int6, m)?)?;
    m.add_function(wrap_pyfunction!(unpack_int6, m)?)?;
    m.add_function(wrap_pyfunction!(gptq_group, m)?)?;
    m.add_function(wrap_pyfunction!(first_non_finite, m)?)?;
    m.add_function(wrap_pyfunction!(gather_qmv_int4, m)?)?;
    m.add_class::<PyXxh3>()?;
    Ok(())
}
