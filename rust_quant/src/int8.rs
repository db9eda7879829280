//! INT8 per-row symmetric: scale = max|w| / 127, q = clip(rint(w / scale), -127, 127), w ~ q * scale.

use rayon::prelude::*;

use crate::dtype::Float;
use crate::shape::task_rows;
use crate::simd::multiversion;

/// Quantizes `w` ([rows, cols] row-major) into `q` and one f32 scale per row.
pub fn quantize<W: Float>(w: &[W], cols: usize, q: &mut [i8], scales: &mut [f32]) -> Result<(), String> {
    if cols == 0 {
        scales.fill(0.0);
        return Ok(());
    }
    q.par_chunks_mut(cols)
        .zip(w.par_chunks(cols))
        .zip(scales.par_iter_mut())
        .with_min_len(task_rows(cols))
        .try_for_each(|((q, w), scale)| quantize_row(w, q, scale))
}

multiversion! {
    fn quantize_row<W: Float>(w: &[W], q: &mut [i8], scale: &mut f32) -> Result<(), String> {
        let (mut amax, mut finite) = (0.0f32, true);
        for &x in w {
            let a = x.to_f32().abs();
            finite &= a <= f32::MAX;
            amax = amax.max(a);
        }
        if !finite {
            return Err("w contains NaN or inf; refusing to quantize it".into());
        }
        *scale = amax / 127.0;
        let s = *scale;
        if s == 0.0 {
            // a zero row, or one so tiny that max/127 underflows: all codes 0, never NaN
            q.fill(0);
        } else {
            for (q, &x) in q.iter_mut().zip(w) {
                *q = (x.to_f32() / s).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
        }
        Ok(())
    }
}

/// out = q * scale in f32, rounded to O.
pub fn dequantize<O: Float>(q: &[i8], scales: &[f32], cols: usize, out: &mut [O]) {
    if cols == 0 {
        return;
    }
    out.par_chunks_mut(cols)
        .zip(q.par_chunks(cols))
        .zip(scales.par_iter())
        .with_min_len(task_rows(cols))
        .for_each(|((out, q), &s)| dequantize_row(q, s, out));
}

multiversion! {
    fn dequantize_row<O: Float>(q: &[i8], s: f32, out: &mut [O]) {
        for (o, &q) in out.iter_mut().zip(q) {
            *o = O::from_f32(q as f32 * s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn round_trip_rows() {
        let w = [1.0f32, -0.5, 0.25, 127.0, 0.0, 0.0, 0.0, 0.0];
        let (mut q, mut s) = ([0i8; 8], [9.0f32; 2]);
        quantize(&w, 4, &mut q, &mut s).unwrap();
        assert_eq!(s, [1.0, 0.0]);
        assert_eq!(q, [1, 0, 0, 127, 0, 0, 0, 0]); // -0.5 rounds half to even
        let mut out = [bf16::ONE; 8];
        dequantize(&q, &s, 4, &mut out);
        assert_eq!(out.map(|x| x.to_f32()), [1.0, 0.0, 0.0, 127.0, 0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn tiny_rows_and_errors() {
        let (mut q, mut s) = ([5i8; 2], [1.0f32]);
        quantize(&[1e-45f32, 0.0], 2, &mut q, &mut s).unwrap(); // max/127 underflows to 0
        assert_eq!((q, s), ([0, 0], [0.0]));
        assert!(quantize(&[1.0f32, f32::INFINITY], 2, &mut q, &mut s).unwrap_err().contains("NaN or inf"));
        assert!(quantize(&[f32::NAN, 1.0f32], 2, &mut q, &mut s).is_err());
        quantize::<f32>(&[], 0, &mut [], &mut s).unwrap(); // one row of zero columns
        assert_eq!(s, [0.0]);
    }
}
