//! Float32 rows times MLX 4-bit affine matrices (uint32 words of 8 codes, the lowest nibble first; a scale and a
//! bias per group of a row): each row by the matrix its expert index picks (a dense layer: one matrix, index 0).
//! What a quantized model decoding on a CPU spends its time in; mlx[cpu]'s float32 `quantized_matmul` and
//! `gather_qmm` run it at ~1 GMAC/s on this project's VM (squishlike/cpu_layers.py).
//!
//! The rows routed to one matrix are taken together: each group's codes are unpacked once, to float32, and dotted
//! with every such row. A group's product is `scale * sum(q * x) + bias * sum(x)` (the affine code `q * scale +
//! bias` summed over the group), each sum in eight lanes that the compiler keeps in one vector register.

use rayon::prelude::*;

use crate::dtype::Float;
use crate::shape::task_rows;
use crate::simd::multiversion;

/// Codes per uint32 word.
const PER_WORD: usize = 8;
/// The largest group: the unpacked codes of a group live on the stack.
const MAX_GROUP: usize = 128;

/// `y[r] = W[experts[r]] @ x[r]` for every row r of `x` ([rows, cols]), W[e] the e-th [out, cols] matrix of
/// `words` ([experts * out, cols / 8]), `scales` and `biases` ([experts * out, cols / group]); `y` is [rows, out].
#[allow(clippy::too_many_arguments)]
pub fn gather_qmv<S: Float>(
    x: &[f32],
    cols: usize,
    words: &[u32],
    scales: &[S],
    biases: &[S],
    group: usize,
    experts: &[u32],
    y: &mut [f32],
) -> Result<(), String> {
    let rows = experts.len();
    if group == 0 || group > MAX_GROUP || !group.is_multiple_of(PER_WORD) || !cols.is_multiple_of(group) {
        return Err(format!("gather_qmv: group_size {group} does not split {cols} columns into groups of 8..128"));
    }
    let out = if rows == 0 { 0 } else { y.len() / rows };
    let matrix_words = out * cols / PER_WORD;
    let count = if matrix_words == 0 { 0 } else { words.len() / matrix_words };
    if let Some(&e) = experts.iter().find(|&&e| e as usize >= count) {
        return Err(format!("gather_qmv: expert index {e} out of range for {count} matrices"));
    }
    // The rows in expert order, and each group's sum of x, so that one expert's rows are contiguous.
    let mut order: Vec<usize> = (0..rows).collect();
    order.sort_by_key(|&r| experts[r]);
    let groups = cols / group;
    let sorted: Vec<f32> = order.iter().flat_map(|&r| &x[r * cols..(r + 1) * cols]).copied().collect();
    let sums: Vec<f32> = sorted.chunks_exact(group).map(|g| g.iter().sum()).collect();
    let mut segments = Vec::new(); // (first sorted row, rows, expert)
    for (i, &r) in order.iter().enumerate() {
        match segments.last_mut() {
            Some((_, n, e)) if *e == experts[r] => *n += 1,
            _ => segments.push((i, 1, experts[r])),
        }
    }
    let block = task_rows(cols);
    let tasks: Vec<(usize, usize, u32, usize)> =
        segments.iter().flat_map(|&(first, n, e)| (0..out).step_by(block).map(move |o| (first, n, e, o))).collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(first, n, e, o0)| {
            let o1 = (o0 + block).min(out);
            let (xs, xsums) = (&sorted[first * cols..(first + n) * cols], &sums[first * groups..(first + n) * groups]);
            let mut products = vec![0f32; (o1 - o0) * n];
            for (o, dots) in (o0..o1).zip(products.chunks_exact_mut(n)) {
                let row = e as usize * out + o;
                row_products(
                    &words[row * cols / PER_WORD..(row + 1) * cols / PER_WORD],
                    &scales[row * groups..(row + 1) * groups],
                    &biases[row * groups..(row + 1) * groups],
                    xs,
                    xsums,
                    group,
                    dots,
                );
            }
            products
        })
        .collect();
    for (&(first, n, _, o0), products) in tasks.iter().zip(&results) {
        for (o, dots) in (o0..).zip(products.chunks_exact(n)) {
            for (i, &dot) in dots.iter().enumerate() {
                y[order[first + i] * out + o] = dot;
            }
        }
    }
    Ok(())
}

multiversion! {
    /// One output row's products with each of `xs`'s rows (`dots`: one per row), from the row's `codes`, `scales`
    /// and `biases` and each x row's group sums `xsums`.
    fn row_products<S: Float>(
        codes: &[u32],
        scales: &[S],
        biases: &[S],
        xs: &[f32],
        xsums: &[f32],
        group: usize,
        dots: &mut [f32],
    ) {
        let groups = scales.len();
        let cols = groups * group;
        dots.fill(0.0);
        let mut unpacked = [0f32; MAX_GROUP];
        for g in 0..groups {
            let q = &mut unpacked[..group];
            for (&w, lanes) in codes[g * group / PER_WORD..(g + 1) * group / PER_WORD].iter().zip(q.chunks_exact_mut(8)) {
                for (k, lane) in lanes.iter_mut().enumerate() {
                    *lane = ((w >> (4 * k)) & 15) as f32;
                }
            }
            let (scale, bias) = (scales[g].to_f32(), biases[g].to_f32());
            for (r, dot) in dots.iter_mut().enumerate() {
                let x = &xs[r * cols + g * group..r * cols + (g + 1) * group];
                let mut acc = [0f32; 8];
                for (qc, xc) in q.chunks_exact(8).zip(x.chunks_exact(8)) {
                    for k in 0..8 {
                        acc[k] += qc[k] * xc[k];
                    }
                }
                let qx = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                *dot += scale * qx + bias * xsums[r * groups + g];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product the slow way: every weight dequantized, one multiply-add at a time, in f64.
    fn reference(
        x: &[f32],
        cols: usize,
        words: &[u32],
        scales: &[f32],
        biases: &[f32],
        group: usize,
        experts: &[u32],
        out: usize,
    ) -> Vec<f64> {
        let mut y = vec![0f64; experts.len() * out];
        for (r, &e) in experts.iter().enumerate() {
            for o in 0..out {
                let row = e as usize * out + o;
                for c in 0..cols {
                    let q = (words[row * cols / 8 + c / 8] >> (4 * (c % 8))) & 15;
                    let g = row * (cols / group) + c / group;
                    y[r * out + o] += (q as f64 * scales[g] as f64 + biases[g] as f64) * x[r * cols + c] as f64;
                }
            }
        }
        y
    }

    #[test]
    fn matches_the_dequantized_product() {
        let (cols, out, count, group) = (256, 24, 3, 64);
        let mut seed = 1u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
            seed
        };
        let words: Vec<u32> = (0..count * out * cols / 8).map(|_| next()).collect();
        let scales: Vec<f32> = (0..count * out * cols / group).map(|_| (next() % 100) as f32 / 1000.0).collect();
        let biases: Vec<f32> = scales.iter().map(|s| -7.5 * s).collect();
        let experts = [2u32, 0, 2, 1, 2];
        let x: Vec<f32> = (0..experts.len() * cols).map(|_| (next() % 2000) as f32 / 1000.0 - 1.0).collect();
        let mut y = vec![0f32; experts.len() * out];
        gather_qmv(&x, cols, &words, &scales, &biases, group, &experts, &mut y).unwrap();
        let want = reference(&x, cols, &words, &scales, &biases, group, &experts, out);
        for (got, want) in y.iter().zip(&want) {
            assert!((*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()), "{got} vs {want}");
        }
    }

    #[test]
    fn refuses_an_expert_out_of_range() {
        let words = vec![0u32; 2 * 8 * 64 / 8];
        let scales = vec![0f32; 2 * 8];
        let mut y = vec![0f32; 8];
        let err = gather_qmv(&[0.0; 64], 64, &words, &scales, &scales, 64, &[2], &mut y).unwrap_err();
        assert!(err.contains("expert index 2"), "{err}");
        assert!(gather_qmv(&[0.0; 64], 64, &words, &scales, &scales, 48, &[0], &mut y).is_err());
    }
}
