//! GPTQ's column loop (Frantar et al. 2022) over one group of columns of an affine scheme. Within a group each row
//! is rounded on its own, so rows run in parallel; squishlike/calibration/gptq.py does the rest: the factor of the
//! inverse Hessian, and the update of the columns after the group (a matrix product).

use rayon::prelude::*;

use crate::affine::{code, dequantize_value, group_grid, Packing};
use crate::dtype::Float;
use crate::shape::task_rows;
use crate::simd::multiversion;

multiversion! {
    /// One row's group (`w`, its `u.len()`.sqrt() values): the grid from the values as they stand, then each value
    /// rounded in turn and its error, divided by u[k, k], taken off the later values by row k of `u`. `w` ends
    /// holding the scaled errors, `q` the codes. Returns the grid's stored (scale, bias).
    fn gptq_row<K: Packing, S: Float>(w: &mut [f32], u: &[f32], clip_search: bool, q: &mut [u8]) -> Result<(f32, f32), String> {
        let group = w.len();
        let levels = K::LEVELS as f32;
        let grid = group_grid::<K, S>(w, clip_search)?;
        let ((ps, pz), (s, z)) = (grid.pick, grid.stored);
        for k in 0..group {
            let (done, later) = w.split_at_mut(k + 1);
            let x = done[k];
            let c = code(x, ps, pz, levels);
            q[k] = c as u8;
            let e = (x - dequantize_value::<S>(c, s, z)) / u[k * group + k];
            done[k] = e;
            for (v, &spread) in later.iter_mut().zip(&u[k * group + k + 1..(k + 1) * group]) {
                *v -= spread * e;
            }
        }
        Ok((s, z))
    }
}

/// Rounds columns [start, start + group) of `w` ([rows, cols] row-major) as GPTQ does, on the scheme's grid
/// (clip search included) chosen per row from the group's values as they stand. `u` is the group's
/// [group, group] block of the upper Cholesky factor of the inverse Hessian. On return those columns of `w` hold
/// the rounding errors divided by u's diagonal (what the caller spreads onto the later columns), `q` ([rows, cols],
/// one byte per code) their codes, and `scales` / `biases` ([rows, cols / group]) the group's grid.
#[allow(clippy::too_many_arguments)]
pub fn gptq_group<K: Packing, S: Float>(
    w: &mut [f32],
    cols: usize,
    start: usize,
    group: usize,
    u: &[f32],
    clip_search: bool,
    q: &mut [u8],
    scales: &mut [S],
    biases: &mut [S],
) -> Result<(), String> {
    K::check_group(cols, group)?;
    if !start.is_multiple_of(group) || start >= cols {
        return Err(format!("start {start} is not the first column of a group of {group} in {cols} columns"));
    }
    if u.len() != group * group {
        return Err(format!("u holds {} values; expected a [{group}, {group}] block", u.len()));
    }
    if let Some(k) = (0..group).find(|&k| !(u[k * group + k] > 0.0 && u[k * group + k].is_finite())) {
        return Err(format!("u[{k}, {k}] = {} is not a positive number: the inverse Hessian is not positive definite",
                           u[k * group + k]));
    }
    let (groups, at) = (cols / group, start / group);
    w.par_chunks_mut(cols)
        .zip(q.par_chunks_mut(cols))
        .zip(scales.par_chunks_mut(groups).zip(biases.par_chunks_mut(groups)))
        .with_min_len(task_rows(group * group))
        .try_for_each(|((w, q), (scales, biases))| {
            let range = start..start + group;
            let (s, z) = gptq_row::<K, S>(&mut w[range.clone()], u, clip_search, &mut q[range])?;
            (scales[at], biases[at]) = (S::from_f32(s), S::from_f32(z));
            Ok(())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affine::quantize;
    use crate::int4::Int4;

    fn wave(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % cols) as f32 / 64.0)).collect()
    }

    fn identity(n: usize) -> Vec<f32> {
        (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect()
    }

    #[test]
    fn identity_factor_rounds_to_nearest() {
        // u = I: no error is spread, so the codes and grid are plain round-to-nearest's and w holds the errors
        let (rows, cols, group) = (3, 64, 32);
        let w0 = wave(rows, cols);
        let (mut packed, mut s0, mut z0) = (vec![0u8; rows * cols / 2], vec![0f32; rows * 2], vec![0f32; rows * 2]);
        quantize::<Int4, f32, f32>(&w0, cols, group, true, &mut packed, &mut s0, &mut z0).unwrap();
        let (mut w, mut q, mut s, mut z) = (w0.clone(), vec![0u8; rows * cols], vec![0f32; rows * 2], vec![0f32; rows * 2]);
        for start in [0, 32] {
            gptq_group::<Int4, f32>(&mut w, cols, start, group, &identity(group), true, &mut q, &mut s, &mut z).unwrap();
        }
        assert_eq!((s.clone(), z.clone()), (s0, z0));
        let mut codes = vec![0u8; rows * cols];
        crate::affine::unpack::<Int4>(&packed, cols, &mut codes);
        assert_eq!(q, codes);
        for i in 0..rows * cols {
            let deq = dequantize_value::<f32>(q[i] as f32, s[i / group], z[i / group]);
            assert_eq!(w[i], w0[i] - deq);
        }
    }

    #[test]
    fn errors_are_spread_onto_later_columns() {
        // u with an off-diagonal entry: column 0's scaled error is taken off column 1 before it is rounded
        let group = 32;
        let mut u = identity(group);
        u[1] = 0.5;
        let w0 = wave(1, group);
        let (mut w, mut q, mut s, mut z) = (w0.clone(), vec![0u8; group], [0f32], [0f32]);
        gptq_group::<Int4, f32>(&mut w, group, 0, group, &u, false, &mut q, &mut s, &mut z).unwrap();
        let e0 = w0[0] - dequantize_value::<f32>(q[0] as f32, s[0], z[0]);
        assert_eq!(w[0], e0);
        assert_eq!(w[1], w0[1] - 0.5 * e0 - dequantize_value::<f32>(q[1] as f32, s[0], z[0]));
    }

    #[test]
    fn refuses_bad_input() {
        let (mut w, mut q, mut s, mut z) = (wave(1, 64), vec![0u8; 64], [0f32; 2], [0f32; 2]);
        let mut run = |start, u: &[f32]| gptq_group::<Int4, f32>(&mut w, 64, start, 32, u, false, &mut q, &mut s, &mut z);
        assert!(run(16, &identity(32)).unwrap_err().contains("start 16"));
        assert!(run(64, &identity(32)).unwrap_err().contains("start 64"));
        assert!(run(0, &identity(16)).unwrap_err().contains("[32, 32]"));
        let mut singular = identity(32);
        singular[33] = 0.0;
        assert!(run(0, &singular).unwrap_err().contains("u[1, 1]"));
        let mut nan = wave(1, 64);
        nan[40] = f32::NAN;
        let err = gptq_group::<Int4, f32>(&mut nan, 64, 32, 32, &identity(32), false, &mut q, &mut s, &mut z);
        assert!(err.unwrap_err().contains("NaN"));
    }
}
