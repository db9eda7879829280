//! Whether stored values are all finite: a store's scales and offsets, checked on every load (docs/format.md §7),
//! where they are already in memory. A NaN or infinite scale would dequantize a whole group to NaN or infinity.

use rayon::prelude::*;

use crate::dtype::Float;

/// Values per task: big enough that a task's loop, one test of the exponent bits per value, runs vectorised.
const CHUNK: usize = 1 << 16;

/// The index of the first NaN or infinite value, None when every value is finite. Chunks are tested in parallel
/// (the common answer, None, needs every value looked at); only the first failing chunk is searched for the index.
pub fn first_non_finite<T: Float>(values: &[T]) -> Option<usize> {
    let any_bad = |c: &[T]| c.iter().fold(false, |bad, &x| bad | !x.is_finite());
    // Most tensors' scales fit in one chunk: tested here, without waking the pool's threads.
    let chunk = if values.len() <= CHUNK {
        any_bad(values).then_some(0)?
    } else {
        values.par_chunks(CHUNK).position_first(any_bad)?
    };
    let start = chunk * CHUNK;
    values[start..].iter().position(|x| !x.is_finite()).map(|i| start + i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn finds_the_first_non_finite_value_of_each_type() {
        let mut values = vec![1.5f32; 3 * CHUNK + 7];
        assert_eq!(first_non_finite(&values), None);
        for (at, bad) in [(3 * CHUNK + 2, f32::INFINITY), (CHUNK + 1, f32::NAN), (5, f32::NEG_INFINITY)] {
            values[at] = bad;
            assert_eq!(first_non_finite(&values), Some(at));
        }
        let halves: Vec<f16> = [0.0, f16::MAX.to_f32(), f32::NAN].iter().map(|&x| f16::from_f32(x)).collect();
        assert_eq!(first_non_finite(&halves), Some(2));
        let brains: Vec<bf16> = [-0.0, 3.0e38, f32::MIN_POSITIVE, f32::INFINITY].iter().map(|&x| bf16::from_f32(x)).collect();
        assert_eq!(first_non_finite(&brains), Some(3));
        assert_eq!(first_non_finite::<f32>(&[]), None);
    }
}
