//! INT3: affine 3-bit groups packed exactly as `mx.quantize(bits=3)` packs them.
//!
//! Layout (found by quantizing known codes with mx.quantize and reading the words back): each row is one
//! little-endian bitstream in which element k occupies bits 3k..3k+2. So 8 codes fill 3 bytes, 32 codes fill 3
//! u32 words, and a word boundary cuts through elements 10 and 21 of every 32.

use crate::affine::Packing;

pub struct Int3;

impl Packing for Int3 {
    const NAME: &'static str = "int3";
    const LEVELS: u8 = 7;
    const GROUP_SIZES: &'static [usize] = &[32, 64, 128];
    type Word = u32;
    const BLOCK: usize = 32;
    type Table<T: Copy + Sync> = [T; 8];

    fn table<T: Copy + Sync>(f: impl FnMut(usize) -> T) -> [T; 8] {
        std::array::from_fn(f)
    }

    fn words(cols: usize) -> usize {
        cols * 3 / 32
    }

    fn pack_row(q: &[u8], words: &mut [u32]) {
        for (w, q) in words.chunks_exact_mut(3).zip(q.chunks_exact(32)) {
            let bits = q.iter().enumerate().fold(0u128, |acc, (k, &v)| acc | (v as u128) << (3 * k));
            w.copy_from_slice(&[bits as u32, (bits >> 32) as u32, (bits >> 64) as u32]);
        }
    }

    #[inline(always)]
    fn unpack_row<T: Copy + Sync>(words: &[u32], table: &[T; 8], out: &mut [T]) {
        for (w, out) in words.chunks_exact(3).zip(out.chunks_exact_mut(32)) {
            let bits = w[0] as u128 | (w[1] as u128) << 32 | (w[2] as u128) << 64;
            for (k, o) in out.iter_mut().enumerate() {
                *o = table[(bits >> (3 * k)) as usize & 7];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affine::{dequantize, pack, quantize, unpack};
    use half::f16;

    #[test]
    fn bitstream_layout() {
        // element k at stream bits 3k..3k+2: element 10 straddles words 0 and 1 (bits 30..32)
        let mut q = [0u8; 32];
        q[10] = 0b111;
        let mut words = [0u32; 3];
        pack::<Int3>(&q, 32, &mut words).unwrap();
        assert_eq!(words, [0b11 << 30, 0b1, 0]);
        (q[0], q[31]) = (5, 6);
        pack::<Int3>(&q, 32, &mut words).unwrap();
        let mut back = [0u8; 32];
        unpack::<Int3>(&words, 32, &mut back);
        assert_eq!(back, q);
        assert!(pack::<Int3>(&[8; 32], 32, &mut words).unwrap_err().contains("8"));
    }

    #[test]
    fn quantize_dequantize_ramp() {
        let w: Vec<f32> = (0..64).map(|i| (i % 8) as f32 * 0.25).collect();
        let (mut words, mut s, mut z) = (vec![0u32; 6], vec![0f32; 1], vec![0f32; 1]);
        quantize::<Int3, f32, f32>(&w, 64, 64, false, &mut words, &mut s, &mut z).unwrap();
        let mut out = vec![f16::ZERO; 64];
        dequantize::<Int3, f32, f16>(&words, &s, &z, 64, 64, &mut out);
        assert!(out.iter().zip(&w).all(|(o, &x)| o.to_f32() == x));
    }
}
