//! Group-wise INT8: MLX's 8-bit affine groups, one code per byte, on the grid `mx.quantize(bits=8)` chooses.
//!
//! MLX packs 8-bit codes into u32 words LSB first (element k at bits 8k..8k+7), which is exactly these bytes read
//! as little-endian words: a group-wise INT8 store repacks into MLX without touching a byte.

use crate::affine::{dequantize_value, mlx_grid, Grid, Packing};
use crate::dtype::Float;

pub struct Int8g;

impl Packing for Int8g {
    const NAME: &'static str = "int8g";
    const LEVELS: u8 = 255;
    const GROUP_SIZES: &'static [usize] = &[32, 64, 128];
    type Word = u8;
    const BLOCK: usize = 1;
    type Table<T: Copy + Sync> = [T; 256];

    fn table<T: Copy + Sync>(f: impl FnMut(usize) -> T) -> [T; 256] {
        std::array::from_fn(f)
    }

    fn words(cols: usize) -> usize {
        cols
    }

    fn pack_row(q: &[u8], packed: &mut [u8]) {
        packed.copy_from_slice(q);
    }

    #[inline(always)]
    fn unpack_row<T: Copy + Sync>(packed: &[u8], table: &[T; 256], out: &mut [T]) {
        for (o, &q) in out.iter_mut().zip(packed) {
            *o = table[q as usize];
        }
    }

    /// Computed per element: a 256-entry table would cost more than the group it serves.
    #[inline(always)]
    fn dequantize_group<S: Float, O: Float>(packed: &[u8], scale: S, bias: S, out: &mut [O]) {
        let (s, z) = (scale.to_f32(), bias.to_f32());
        for (o, &q) in out.iter_mut().zip(packed) {
            *o = O::from_f32(dequantize_value::<S>(q as f32, s, z));
        }
    }

    #[inline(always)]
    fn grid<S: Float>(lo: f32, hi: f32) -> Grid {
        mlx_grid::<S>(lo, hi, Self::LEVELS as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affine::{dequantize, quantize, unpack};
    use half::bf16;

    #[test]
    fn grid_puts_the_far_end_on_a_code() {
        // [-1, 0.5]: -1 is the far end, so it is the bias and code 0; 0 sits on code 170, so the scale is 1/170
        let g = mlx_grid::<f32>(-1.0, 0.5, 255.0);
        assert_eq!(g.pick, (-1.0 / -170.0, -1.0));
        // [-0.5, 1]: 1 is the far end, so it is the bias and code 0, and the scale is negative
        let g = mlx_grid::<f32>(-0.5, 1.0, 255.0);
        assert_eq!(g.pick, (1.0 / -170.0, 1.0));
        // a zero group: the scale stays -eps and the bias is 0
        let g = mlx_grid::<f32>(0.0, 0.0, 255.0);
        assert_eq!(g.pick, (-(1e-7f64 as f32), 0.0));
    }

    #[test]
    fn quantize_dequantize_on_grid() {
        // codes 0, 2, ..., 252 and 255 at step 0.5, then negated at step 0.25: both ends and every value lie on the
        // grid (exactly representable in bf16), so the round trip is exact
        let c: Vec<f32> = (0..127).map(|i| 2.0 * i as f32).chain([255.0]).collect();
        let w: Vec<f32> = c.iter().map(|c| c * 0.5).chain(c.iter().map(|c| c * -0.25)).collect();
        let (mut codes, mut s, mut z) = (vec![0u8; 256], vec![bf16::ZERO; 2], vec![bf16::ZERO; 2]);
        quantize::<Int8g, f32, bf16>(&w, 128, 128, false, &mut codes, &mut s, &mut z).unwrap();
        assert_eq!((s[0].to_f32(), z[0].to_f32(), s[1].to_f32(), z[1].to_f32()), (-0.5, 127.5, 0.25, -63.75));
        let mut out = vec![0f32; 256];
        dequantize::<Int8g, bf16, f32>(&codes, &s, &z, 128, 128, &mut out);
        assert_eq!(out, w);
        let mut back = vec![0u8; 256];
        unpack::<Int8g>(&codes, 128, &mut back);
        assert_eq!(back, codes);
    }

    #[test]
    fn rejects_non_finite() {
        let mut w = vec![0.5f32; 32];
        w[7] = f32::INFINITY;
        let (mut q, mut s, mut z) = (vec![0u8; 32], vec![0f32; 1], vec![0f32; 1]);
        let err = quantize::<Int8g, f32, f32>(&w, 32, 32, false, &mut q, &mut s, &mut z).unwrap_err();
        assert!(err.contains("NaN or inf"));
    }
}
