//! INT2, INT3, INT5 and INT6: affine B-bit groups packed exactly as `mx.quantize(bits=B)` packs them.
//!
//! Layout (found by quantizing known codes with mx.quantize and reading the words back, for B = 2, 3, 5 and 6):
//! each row is one little-endian bitstream of u32 words in which element k occupies bits B*k..B*k+B-1. So 8 codes
//! fill B bytes and 32 codes fill B words; for B = 3, 5 and 6 a word boundary cuts through some codes. (4 and 8 bits
//! are the same stream, but those schemes keep bytes: int4.rs, int8g.rs.)

use crate::affine::Packing;

/// The B-bit bitstream scheme; `N` is its number of codes, 2^B (a separate parameter so that a code table can be
/// an array of exactly N values on stable Rust).
pub struct Bits<const B: usize, const N: usize>;

pub type Int2 = Bits<2, 4>;
pub type Int3 = Bits<3, 8>;
pub type Int5 = Bits<5, 32>;
pub type Int6 = Bits<6, 64>;

const NAMES: [&str; 7] = ["", "", "int2", "int3", "", "int5", "int6"];

impl<const B: usize, const N: usize> Packing for Bits<B, N> {
    const NAME: &'static str = NAMES[B];
    const LEVELS: u8 = {
        assert!(N == 1 << B && B < 8, "Bits<B, N> needs N = 2^B, B < 8");
        (N - 1) as u8
    };
    const GROUP_SIZES: &'static [usize] = &[32, 64, 128];
    type Word = u32;
    const BLOCK: usize = 32;
    type Table<T: Copy + Sync> = [T; N];

    fn table<T: Copy + Sync>(f: impl FnMut(usize) -> T) -> [T; N] {
        std::array::from_fn(f)
    }

    fn words(cols: usize) -> usize {
        cols * B / 32
    }

    fn pack_row(q: &[u8], words: &mut [u32]) {
        // 8 codes at a time are 8 * B bits, B whole bytes of the stream: one u64 holds them
        let mut bytes = [0u8; 32]; // a block's B words, as stream bytes
        for (w, q) in words.chunks_exact_mut(B).zip(q.chunks_exact(32)) {
            for (eight, out) in q.chunks_exact(8).zip(bytes.chunks_exact_mut(B)) {
                let bits = eight.iter().enumerate().fold(0u64, |acc, (k, &v)| acc | (v as u64) << (B * k));
                out.copy_from_slice(&bits.to_le_bytes()[..B]);
            }
            for (w, four) in w.iter_mut().zip(bytes.chunks_exact(4)) {
                *w = u32::from_le_bytes([four[0], four[1], four[2], four[3]]);
            }
        }
    }

    #[inline(always)]
    fn unpack_row<T: Copy + Sync>(words: &[u32], table: &[T; N], out: &mut [T]) {
        let mut bytes = [0u8; 32];
        for (w, out) in words.chunks_exact(B).zip(out.chunks_exact_mut(32)) {
            for (four, w) in bytes.chunks_exact_mut(4).zip(w) {
                four.copy_from_slice(&w.to_le_bytes());
            }
            for (eight, out) in bytes.chunks_exact(B).zip(out.chunks_exact_mut(8)) {
                let mut le = [0u8; 8];
                le[..B].copy_from_slice(eight);
                let bits = u64::from_le_bytes(le);
                for (k, o) in out.iter_mut().enumerate() {
                    *o = table[(bits >> (B * k)) as usize & (N - 1)];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affine::{dequantize, pack, quantize, unpack};
    use half::f16;

    /// Packs one block of 32 codes into B words.
    fn packed<K: Packing<Word = u32>>(q: &[u8; 32]) -> Vec<u32> {
        let mut words = vec![0u32; K::words(32)];
        pack::<K>(q, 32, &mut words).unwrap();
        words
    }

    #[test]
    fn bitstream_layout() {
        // element k at stream bits B*k..: a code straddling a word boundary splits LSB-first across both words
        let mut q = [0u8; 32];
        q[10] = 0b111;
        assert_eq!(packed::<Int3>(&q), [0b11 << 30, 0b1, 0]);
        let mut q = [0u8; 32];
        q[6] = 0b11111; // 5-bit element 6: bits 30..35
        assert_eq!(packed::<Int5>(&q), [0b11 << 30, 0b111, 0, 0, 0]);
        let mut q = [0u8; 32];
        q[5] = 0b111111; // 6-bit element 5: bits 30..36
        assert_eq!(packed::<Int6>(&q)[..2], [0b11 << 30, 0b1111]);
        let mut q = [0u8; 32];
        (q[0], q[15], q[16]) = (1, 3, 2); // 2-bit: 16 whole codes per word
        assert_eq!(packed::<Int2>(&q), [1 | 3 << 30, 2]);
    }

    fn round_trip<K: Packing<Word = u32>>() {
        let q: Vec<u8> = (0..96).map(|i| (i * 37 % 251) as u8 & K::LEVELS).collect();
        let mut words = vec![0u32; K::words(96)];
        pack::<K>(&q, 96, &mut words).unwrap();
        let mut back = vec![0u8; 96];
        unpack::<K>(&words, 96, &mut back);
        assert_eq!(back, q);
        let too_big = vec![K::LEVELS + 1; 32];
        assert!(pack::<K>(&too_big, 32, &mut words[..K::words(32)])
            .unwrap_err()
            .contains(&(K::LEVELS + 1).to_string()));
    }

    fn ramp_is_exact<K: Packing<Word = u32>>() {
        // a ramp through every code, twice: every value is a code point, so the round trip is exact
        let levels = K::LEVELS as usize + 1;
        let w: Vec<f32> = (0..128).map(|i| (i % levels) as f32 * 0.25).collect();
        let (mut words, mut s, mut z) = (vec![0u32; K::words(128)], vec![0f32; 2], vec![0f32; 2]);
        quantize::<K, f32, f32>(&w, 128, 64, false, &mut words, &mut s, &mut z).unwrap();
        let mut out = vec![f16::ZERO; 128];
        dequantize::<K, f32, f16>(&words, &s, &z, 128, 64, &mut out);
        assert!(out.iter().zip(&w).all(|(o, &x)| o.to_f32() == x), "{}", K::NAME);
    }

    fn round_trips<K: Packing<Word = u32>>() {
        round_trip::<K>();
        ramp_is_exact::<K>();
    }

    #[test]
    fn every_width_round_trips() {
        round_trips::<Int2>();
        round_trips::<Int3>();
        round_trips::<Int5>();
        round_trips::<Int6>();
    }
}
