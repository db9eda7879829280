//! INT4: affine 4-bit groups stored two codes per byte, the low nibble holding the even column.
//!
//! MLX packs 4-bit codes into u32 words LSB first (element k at bits 4k..4k+3), which is exactly these bytes read
//! as little-endian words: an INT4 store repacks into MLX without touching a byte.

use crate::affine::Packing;
use crate::dtype::Float;

pub struct Int4;

impl Packing for Int4 {
    const NAME: &'static str = "int4";
    const LEVELS: u8 = 15;
    const GROUP_SIZES: &'static [usize] = &[32, 64, 128];
    type Word = u8;
    const BLOCK: usize = 2;
    type Table<T: Copy + Sync> = [T; 16];

    fn table<T: Copy + Sync>(f: impl FnMut(usize) -> T) -> [T; 16] {
        std::array::from_fn(f)
    }

    fn words(cols: usize) -> usize {
        cols / 2
    }

    fn pack_row(q: &[u8], packed: &mut [u8]) {
        for (p, pair) in packed.iter_mut().zip(q.chunks_exact(2)) {
            *p = pair[0] | pair[1] << 4;
        }
    }

    #[inline(always)]
    fn unpack_row<T: Copy + Sync>(packed: &[u8], table: &[T; 16], out: &mut [T]) {
        for (&b, pair) in packed.iter().zip(out.chunks_exact_mut(2)) {
            pair[0] = table[(b & 15) as usize];
            pair[1] = table[(b >> 4) as usize];
        }
    }

    #[inline(always)]
    fn unpack_values<O: Float>(packed: &[u8], table: &[O; 16], out: &mut [O]) {
        #[cfg(target_arch = "x86_64")]
        if let (Some(Ok(table)), Some(out)) = (O::bits16(table).map(<&[u16; 16]>::try_from), O::bits16_mut(out)) {
            if std::arch::is_x86_feature_detected!("ssse3") {
                // SAFETY: the CPU supports SSSE3.
                return unsafe { unpack_bits16_ssse3(packed, table, out) };
            }
        }
        Self::unpack_row(packed, table, out)
    }
}

/// The classic nibble-table trick for 16-bit outputs: the 16-entry table's low bytes and high bytes each fill one
/// SSE register, so one byte shuffle (pshufb) looks up 16 codes at once. 16 packed bytes become 32 outputs in
/// about 18 instructions instead of 32 scalar lookups. `packed.len()` is a multiple of 16 (groups of 32 codes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
unsafe fn unpack_bits16_ssse3(packed: &[u8], table: &[u16; 16], out: &mut [u16]) {
    use std::arch::x86_64::*;
    let entries = table.as_ptr().cast::<__m128i>();
    let (t0, t1) = (_mm_loadu_si128(entries), _mm_loadu_si128(entries.add(1)));
    let low = _mm_set1_epi16(0xFF);
    let low_bytes = _mm_packus_epi16(_mm_and_si128(t0, low), _mm_and_si128(t1, low));
    let high_bytes = _mm_packus_epi16(_mm_srli_epi16(t0, 8), _mm_srli_epi16(t1, 8));
    let nibble = _mm_set1_epi8(0x0F);
    for (src, dst) in packed.chunks_exact(16).zip(out.chunks_exact_mut(32)) {
        let x = _mm_loadu_si128(src.as_ptr().cast());
        let (even, odd) = (_mm_and_si128(x, nibble), _mm_and_si128(_mm_srli_epi16(x, 4), nibble));
        let dst = dst.as_mut_ptr().cast::<__m128i>();
        // codes 0..16 and 16..32 in element order, then each code's low and high byte interleaved into a u16
        for (i, codes) in [_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd)].into_iter().enumerate() {
            let (lo, hi) = (_mm_shuffle_epi8(low_bytes, codes), _mm_shuffle_epi8(high_bytes, codes));
            _mm_storeu_si128(dst.add(2 * i), _mm_unpacklo_epi8(lo, hi));
            _mm_storeu_si128(dst.add(2 * i + 1), _mm_unpackhi_epi8(lo, hi));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affine::{dequantize, pack, quantize, unpack};
    use half::bf16;

    #[test]
    fn pack_layout_and_round_trip() {
        let q: Vec<u8> = (0..64).map(|i| (i * 7 % 16) as u8).collect();
        let mut packed = vec![0u8; 32];
        pack::<Int4>(&q, 16, &mut packed).unwrap();
        assert_eq!(packed[0], q[0] | q[1] << 4);
        let mut back = vec![0u8; 64];
        unpack::<Int4>(&packed, 16, &mut back);
        assert_eq!(back, q);
        assert!(pack::<Int4>(&[16, 0], 2, &mut [0]).unwrap_err().contains("16"));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn ssse3_lookup_matches_scalar() {
        if !std::arch::is_x86_feature_detected!("ssse3") {
            return;
        }
        let table: [u16; 16] = std::array::from_fn(|i| (i as u16).wrapping_mul(0x9E37) ^ 0x5A5A);
        let packed: Vec<u8> = (0..64u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        let (mut fast, mut scalar) = (vec![0u16; 128], vec![0u16; 128]);
        // SAFETY: SSSE3 was detected above.
        unsafe { unpack_bits16_ssse3(&packed, &table, &mut fast) };
        Int4::unpack_row(&packed, &table, &mut scalar);
        assert_eq!(fast, scalar);
    }

    #[test]
    fn quantize_dequantize_ramp() {
        // two rows of scaled 0..15 ramps: every value is a code point, so the round trip is exact
        let w: Vec<f32> = (0..128).map(|i| (i % 16) as f32 * 0.5 - 1.0).collect();
        let (mut packed, mut s, mut z) = (vec![0u8; 64], vec![bf16::ZERO; 2], vec![bf16::ZERO; 2]);
        quantize::<Int4, f32, bf16>(&w, 64, 64, false, &mut packed, &mut s, &mut z).unwrap();
        let mut out = vec![0f32; 128];
        dequantize::<Int4, bf16, f32>(&packed, &s, &z, 64, 64, &mut out);
        assert_eq!(out, w);
    }
}
