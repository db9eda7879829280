//! The three value types (float32, float16, bfloat16) and their conversions.
//!
//! float16 and bfloat16 come from the `half` crate: float32 -> half rounds to nearest even, overflows to inf and
//! keeps NaN a NaN, exactly like NumPy's float16 cast and the bit trick in `squishlike/quant/reference.py`.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "float32" => Ok(Dtype::F32),
            "float16" => Ok(Dtype::F16),
            "bfloat16" => Ok(Dtype::BF16),
            _ => Err(format!("unknown dtype '{name}'; expected float32, float16 or bfloat16")),
        }
    }
}

/// A value type the kernels read and write. All arithmetic happens in f32.
pub trait Float: Copy + Send + Sync + 'static {
    const NAME: &'static str;
    fn to_f32(self) -> f32;
    /// Round to the nearest value of this type, ties to even.
    fn from_f32(x: f32) -> Self;
    /// Neither NaN nor infinite (not every bit of the exponent set): a test of the bits, which loops vectorise.
    fn is_finite(self) -> bool;

    /// 16-bit values as their raw bits, for kernels that only move values around (None for f32).
    fn bits16(_values: &[Self]) -> Option<&[u16]> {
        None
    }
    fn bits16_mut(_values: &mut [Self]) -> Option<&mut [u16]> {
        None
    }
}

impl Float for f32 {
    const NAME: &'static str = "float32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Float for f16 {
    const NAME: &'static str = "float16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f16::is_finite(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn bits16(values: &[Self]) -> Option<&[u16]> {
        Some(values.reinterpret_cast())
    }
    fn bits16_mut(values: &mut [Self]) -> Option<&mut [u16]> {
        Some(values.reinterpret_cast_mut())
    }
}

impl Float for bf16 {
    const NAME: &'static str = "bfloat16";
    /// The top half of an f32, exactly (no NaN quieting, unlike `bf16::to_f32`, so that it matches the reference).
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        bf16::is_finite(self)
    }
    /// The same rounding as `bf16::from_f32`, written without branches so that loops over it vectorise:
    /// add 0x7FFF plus the lowest kept bit (ties to even), truncate; a NaN keeps its top bits and gets the quiet bit.
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        let b = x.to_bits();
        let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
        bf16::from_bits(if x.is_nan() { (b >> 16) | 0x40 } else { rounded } as u16)
    }
    fn bits16(values: &[Self]) -> Option<&[u16]> {
        Some(values.reinterpret_cast())
    }
    fn bits16_mut(values: &mut [Self]) -> Option<&mut [u16]> {
        Some(values.reinterpret_cast_mut())
    }
}

/// `x` rounded to the nearest `T`, returned as f32 (exact: every `T` value is an f32 value).
#[inline(always)]
pub fn round<T: Float>(x: f32) -> f32 {
    T::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_matches_half() {
        // Every 16-bit top half with the lower halves that decide rounding: exact, tie, just above/below a tie.
        for hi in 0..=0xFFFFu32 {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                let x = f32::from_bits(hi << 16 | lo);
                assert_eq!(<bf16 as Float>::from_f32(x).to_bits(), bf16::from_f32(x).to_bits(), "{:#x}", x.to_bits());
            }
        }
    }

    #[test]
    fn round_keeps_f32_and_rounds_halves() {
        assert_eq!(round::<f32>(0.1), 0.1);
        assert_eq!(round::<f16>(65520.0), f32::INFINITY); // halfway to the next binade overflows
        assert_eq!(round::<f16>(1.0 + 2f32.powi(-11)), 1.0); // tie goes to even
        assert_eq!(round::<bf16>(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6)); // tie goes to even (up)
        assert!(round::<bf16>(f32::NAN).is_nan());
    }

    #[test]
    fn parse_names() {
        assert_eq!(Dtype::parse("bfloat16"), Ok(Dtype::BF16));
        assert!(Dtype::parse("int8").unwrap_err().contains("int8"));
    }
}
