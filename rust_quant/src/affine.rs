//! Group-wise affine quantization shared by INT2..INT6 and group-wise INT8 (MLX's "affine" mode):
//! w ~ q * scale + bias.
//!
//! `squishlike/quant/reference.py` is the spec. Every step below is the same float32 operation, in the same order,
//! as there (Rust never fuses a multiply and an add), so the two agree bit for bit. The schemes differ in how codes
//! are packed and in how a group's grid is chosen, which is what a `Packing` says.

use rayon::prelude::*;

use crate::dtype::{round, Float};
use crate::shape::task_rows;
use crate::simd::multiversion;

/// How one affine scheme chooses a group's grid and packs its codes, one row at a time.
pub trait Packing {
    const NAME: &'static str;
    /// The largest code (2^bits - 1).
    const LEVELS: u8;
    /// Group sizes `mx.quantize` accepts for this scheme.
    const GROUP_SIZES: &'static [usize];
    type Word: Copy + Send + Sync;
    /// Codes per packing unit: a row's length must be a multiple of it.
    const BLOCK: usize;

    /// Packed words holding `cols` codes (`cols` a multiple of BLOCK).
    fn words(cols: usize) -> usize;
    /// A value per code, LEVELS + 1 of them (an array, so that a lookup by a masked code needs no bounds check).
    type Table<T: Copy + Sync>: Sync;
    /// The table whose entry q is `f(q)`.
    fn table<T: Copy + Sync>(f: impl FnMut(usize) -> T) -> Self::Table<T>;

    /// Packs one row of codes (one byte each, already known to be <= LEVELS).
    fn pack_row(q: &[u8], packed: &mut [Self::Word]);
    /// Unpacks one row (or group) of codes, mapping each through `table`.
    fn unpack_row<T: Copy + Sync>(packed: &[Self::Word], table: &Self::Table<T>, out: &mut [T]);
    /// `unpack_row` for dequantization; a scheme may override it with a faster way for some output types.
    fn unpack_values<O: Float>(packed: &[Self::Word], table: &Self::Table<O>, out: &mut [O]) {
        Self::unpack_row(packed, table, out)
    }
    /// Dequantizes one group: by default a table of the output value of every code, then one lookup per element
    /// (cheap while the codes are fewer than the group's elements).
    #[inline(always)]
    fn dequantize_group<S: Float, O: Float>(packed: &[Self::Word], scale: S, bias: S, out: &mut [O]) {
        let (s, z) = (scale.to_f32(), bias.to_f32());
        Self::unpack_values(packed, &Self::table(|q| O::from_f32(dequantize_value::<S>(q as f32, s, z))), out)
    }

    /// The grid of a group spanning [lo, hi]. By default the min/max grid, which picks codes with the stored values.
    #[inline(always)]
    fn grid<S: Float>(lo: f32, hi: f32) -> Grid {
        min_max_grid::<S>(lo, hi, Self::LEVELS as f32)
    }

    /// Checks that rows of `cols` codes can be packed.
    fn check_cols(cols: usize) -> Result<(), String> {
        if !cols.is_multiple_of(Self::BLOCK) {
            return Err(format!("{}: {cols} columns are not a multiple of {}", Self::NAME, Self::BLOCK));
        }
        Ok(())
    }

    /// Checks a group size, and that rows of `cols` values split into such groups.
    fn check_group(cols: usize, group: usize) -> Result<(), String> {
        if !Self::GROUP_SIZES.contains(&group) {
            return Err(format!(
                "{}: group_size {group} not supported; use one of {:?}",
                Self::NAME,
                Self::GROUP_SIZES
            ));
        }
        if !cols.is_multiple_of(group) {
            return Err(format!("{}: {cols} columns are not divisible by group_size {group}", Self::NAME));
        }
        Ok(())
    }
}

/// Clip search tries shrinking each end of a group's [min, max] toward the other by k % of the width,
/// k = 0..=10 (width factors 1.00, 0.98, ..., 0.80); the shrink is the f32 nearest to k / 100.
const CLIP_STEPS: u32 = 11;

fn clip_shrink(k: u32) -> f32 {
    (k as f64 / 100.0) as f32
}

/// A group's grid: the scale and bias its codes are picked with, and the scale and bias stored (rounded to the
/// storage type S, kept as f32), which are what the runtime dequantizes with.
#[derive(Clone, Copy)]
pub struct Grid {
    pub pick: (f32, f32),
    pub stored: (f32, f32),
}

/// The min/max grid (INT4, INT3): scale (hi - lo) / levels and bias lo, rounded to S, and codes picked with them.
#[inline(always)]
fn min_max_grid<S: Float>(lo: f32, hi: f32, levels: f32) -> Grid {
    let stored = (round::<S>((hi - lo) / levels), round::<S>(lo));
    Grid { pick: stored, stored }
}

/// The grid `mx.quantize` chooses on mlx[cpu] 0.32.4, all in f32: the end of [lo, hi] farther from zero (`edge`)
/// falls exactly on a code, the scale's sign points from it into the group, and the bias is `edge` (or 0 where
/// edge rounds to code 0). Codes are picked with the unrounded scale and bias, as MLX does; then both are rounded
/// to S. A scale of 0 (edge / inf) picks code 0, whose value is then the bias.
#[inline(always)]
pub fn mlx_grid<S: Float>(lo: f32, hi: f32, levels: f32) -> Grid {
    let eps = 1e-7f64 as f32; // MLX's `float eps = 1e-7`
    let far_low = lo.abs() > hi.abs();
    let width = ((hi - lo) / levels).max(eps);
    let (mut s, edge) = if far_low { (width, lo) } else { (-width, hi) };
    let q0 = (edge / s).round_ties_even();
    let mut z = 0.0;
    if q0 != 0.0 {
        (s, z) = (edge / q0, edge);
    }
    Grid { pick: (s, z), stored: (round::<S>(s), round::<S>(z)) }
}

/// The code of w, q = clip(rint((w - z) / s), 0, levels), as an f32 (an integer; kept in f32 so that loops over
/// it vectorise). A zero scale (a constant group) gives q = 0.
#[inline(always)]
pub fn code(w: f32, s: f32, z: f32, levels: f32) -> f32 {
    if s == 0.0 {
        0.0
    } else {
        ((w - z) / s).round_ties_even().clamp(0.0, levels)
    }
}

/// What `mx.dequantize` computes on mlx[cpu] 0.32.4 (found by experiment for f32, f16 and bf16 scales): the product
/// and then the sum are each rounded to the scale's type S. The result is an S value, carried as f32.
#[inline(always)]
pub fn dequantize_value<S: Float>(q: f32, s: f32, z: f32) -> f32 {
    round::<S>(round::<S>(q * s) + z)
}

/// Squared error of a group quantized on `grid` and dequantized as the runtime does, in f64. The order of the
/// additions is fixed so that the loop vectorises and the reference's `_sq_error` can follow it exactly: eight
/// running sums, lane j taking elements j, j+8, j+16, ... in turn, then the eight added in lane order.
#[inline(always)]
fn sq_error<S: Float>(w: &[f32], grid: Grid, levels: f32) -> f64 {
    let ((ps, pz), (s, z)) = (grid.pick, grid.stored);
    let mut lanes = [0.0f64; 8];
    for eight in w.chunks_exact(8) {
        for (lane, &x) in lanes.iter_mut().zip(eight) {
            let d = dequantize_value::<S>(code(x, ps, pz, levels), s, z) as f64 - x as f64;
            *lane += d * d;
        }
    }
    lanes.iter().fold(0.0, |sum, &lane| sum + lane)
}

/// The grid a group of values is stored on: its [min, max] grid, or with `clip_search` the narrowed one whose
/// dequantized values are closest (squared error). Fails on NaN/inf or when a scale or bias does not fit S.
#[inline(always)]
pub fn group_grid<K: Packing, S: Float>(w: &[f32], clip_search: bool) -> Result<Grid, String> {
    let levels = K::LEVELS as f32;
    let (mut lo, mut hi, mut finite) = (f32::INFINITY, f32::NEG_INFINITY, true);
    for &x in w {
        finite &= x.is_finite();
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if !finite {
        return Err("w contains NaN or inf; refusing to quantize it".into());
    }
    // min/max may return either zero when a group holds both -0.0 and +0.0; adding +0.0 makes it +0.0.
    (lo, hi) = (lo + 0.0, hi + 0.0);
    let mut grid = K::grid::<S>(lo, hi);
    if !(grid.stored.0.is_finite() && grid.stored.1.is_finite()) {
        let (scheme, dtype) = (K::NAME, S::NAME);
        return Err(format!("{scheme}: a group's scale or bias overflows {dtype}; use a wider scale_dtype"));
    }
    if clip_search {
        let mut best = sq_error::<S>(w, grid, levels);
        let span = hi - lo;
        for k in 1..CLIP_STEPS {
            let t = clip_shrink(k);
            let grid_k = K::grid::<S>(lo + t * span, hi - t * span);
            let err = sq_error::<S>(w, grid_k, levels);
            if err < best {
                // strict: on a tie the wider range (tried first) stays
                (best, grid) = (err, grid_k);
            }
        }
    }
    Ok(grid)
}

multiversion! {
    /// Quantizes one row: codes into `q` (one byte per element) and one scale and bias per group.
    fn quantize_row<K: Packing, S: Float>(
        w: &[f32],
        group: usize,
        clip_search: bool,
        q: &mut [u8],
        scales: &mut [S],
        biases: &mut [S],
    ) -> Result<(), String> {
        let levels = K::LEVELS as f32;
        let groups = w.chunks_exact(group).zip(q.chunks_exact_mut(group));
        for ((w, q), (scale, bias)) in groups.zip(scales.iter_mut().zip(biases.iter_mut())) {
            let grid = group_grid::<K, S>(w, clip_search)?;
            let (s, z) = grid.pick;
            for (q, &x) in q.iter_mut().zip(w) {
                *q = code(x, s, z, levels) as u8;
            }
            (*scale, *bias) = (S::from_f32(grid.stored.0), S::from_f32(grid.stored.1));
        }
        Ok(())
    }
}

/// Quantizes `w` ([rows, cols] row-major; cols checked with `check_group`) into packed codes and one
/// scale and bias per group. Fails on NaN/inf or when a scale or bias does not fit S.
pub fn quantize<K: Packing, W: Float, S: Float>(
    w: &[W],
    cols: usize,
    group: usize,
    clip_search: bool,
    packed: &mut [K::Word],
    scales: &mut [S],
    biases: &mut [S],
) -> Result<(), String> {
    if cols == 0 {
        return Ok(());
    }
    let words = K::words(cols);
    let groups = cols / group;
    packed
        .par_chunks_mut(words)
        .zip(w.par_chunks(cols))
        .zip(scales.par_chunks_mut(groups).zip(biases.par_chunks_mut(groups)))
        .with_min_len(task_rows(cols))
        .try_for_each_init(
            || (vec![0f32; cols], vec![0u8; cols]),
            |(row, q), ((packed, w), (scales, biases))| {
                for (f, &x) in row.iter_mut().zip(w) {
                    *f = x.to_f32();
                }
                quantize_row::<K, S>(row, group, clip_search, q, scales, biases)?;
                K::pack_row(q, packed);
                Ok(())
            },
        )
}

/// Dequantizes [rows, cols] packed codes into `out`: per group, a table of the output value of every code, then
/// one lookup per element.
pub fn dequantize<K: Packing, S: Float, O: Float>(
    packed: &[K::Word],
    scales: &[S],
    biases: &[S],
    cols: usize,
    group: usize,
    out: &mut [O],
) {
    if cols == 0 {
        return;
    }
    let words = K::words(cols);
    let (groups, group_words) = (cols / group, words / (cols / group));
    out.par_chunks_mut(cols)
        .zip(packed.par_chunks(words))
        .zip(scales.par_chunks(groups).zip(biases.par_chunks(groups)))
        .with_min_len(task_rows(cols))
        .for_each(|((out, packed), (scales, biases))| {
            dequantize_row::<K, S, O>(packed, group_words, scales, biases, group, out)
        });
}

multiversion! {
    fn dequantize_row<K: Packing, S: Float, O: Float>(
        packed: &[K::Word],
        group_words: usize,
        scales: &[S],
        biases: &[S],
        group: usize,
        out: &mut [O],
    ) {
        let parts = out.chunks_exact_mut(group).zip(packed.chunks_exact(group_words));
        for ((out, packed), (&s, &z)) in parts.zip(scales.iter().zip(biases)) {
            K::dequantize_group::<S, O>(packed, s, z, out);
        }
    }
}

/// Packs [rows, cols] codes (cols a multiple of BLOCK); fails if a code exceeds LEVELS.
pub fn pack<K: Packing>(q: &[u8], cols: usize, packed: &mut [K::Word]) -> Result<(), String> {
    if let Some(v) = q.par_iter().copied().find_any(|&v| v > K::LEVELS) {
        return Err(format!("{}: q holds {v}; values must be 0..{}", K::NAME, K::LEVELS));
    }
    if cols == 0 {
        return Ok(());
    }
    let words = K::words(cols);
    packed
        .par_chunks_mut(words)
        .zip(q.par_chunks(cols))
        .with_min_len(task_rows(cols))
        .for_each(|(packed, q)| K::pack_row(q, packed));
    Ok(())
}

/// Unpacks [rows, words] packed codes into [rows, cols] codes.
pub fn unpack<K: Packing>(packed: &[K::Word], cols: usize, q: &mut [u8]) {
    if cols == 0 {
        return;
    }
    let codes = K::table(|q| q as u8);
    let words = K::words(cols);
    q.par_chunks_mut(cols)
        .zip(packed.par_chunks(words))
        .with_min_len(task_rows(cols))
        .for_each(|(q, packed)| K::unpack_row(packed, &codes, q));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int4::Int4;
    use half::{bf16, f16};

    fn quantize_group<S: Float + Default>(w: &[f32], clip: bool) -> Result<(Vec<u8>, S, S), String> {
        let (mut q, mut s, mut z) = (vec![0u8; w.len()], [S::default()], [S::default()]);
        quantize_row::<Int4, S>(w, w.len(), clip, &mut q, &mut s, &mut z)?;
        Ok((q, s[0], z[0]))
    }

    #[test]
    fn group_checks() {
        assert!(Int4::check_group(128, 64).is_ok());
        assert!(Int4::check_group(128, 48).unwrap_err().contains("48"));
        assert!(Int4::check_group(96, 64).unwrap_err().contains("96"));
    }

    #[test]
    fn ramp_is_exact() {
        // 0..15 twice: scale 1, bias 0, the codes are the values, dequantization is exact
        let w: Vec<f32> = (0..32).map(|i| (i % 16) as f32).collect();
        let (q, s, z) = quantize_group::<bf16>(&w, false).unwrap();
        assert_eq!((s.to_f32(), z.to_f32()), (1.0, 0.0));
        let (mut packed, mut out) = (vec![0u8; 16], vec![0f32; 32]);
        Int4::pack_row(&q, &mut packed);
        Int4::dequantize_group::<bf16, f32>(&packed, s, z, &mut out);
        assert_eq!(out, w);
    }

    #[test]
    fn constant_and_signed_zero_groups() {
        let mut w = vec![-0.0f32; 32];
        w[5] = 0.0;
        let (q, s, z) = quantize_group::<f32>(&w, true).unwrap();
        assert_eq!((s.to_bits(), z.to_bits()), (0, 0)); // +0.0, never NaN
        assert!(q.iter().all(|&q| q == 0));
    }

    #[test]
    fn rejects_non_finite_and_overflow() {
        let mut w = vec![1.0f32; 32];
        w[3] = f32::NAN;
        assert!(quantize_group::<f16>(&w, false).unwrap_err().contains("NaN"));
        w[3] = 1e6; // beyond float16
        assert!(quantize_group::<f16>(&w, false).unwrap_err().contains("float16"));
        assert!(quantize_group::<bf16>(&w, false).is_ok());
    }

    #[test]
    fn clip_search_helps_long_tails() {
        // cubes of an even spread: most values near 0, a few out to +-1
        let w: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 31.5) / 32.0).map(|x| x * x * x).collect();
        let err = |clip| {
            let (_, s, z) = quantize_group::<f32>(&w, clip).unwrap();
            sq_error::<f32>(&w, Grid { pick: (s, z), stored: (s, z) }, 15.0)
        };
        assert!(err(true) < err(false));
    }
}
