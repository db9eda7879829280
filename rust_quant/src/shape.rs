//! Shape rules shared by every kernel: an N-D array is seen as 2-D, [rows = product of the leading dims, cols].

/// (rows, cols) of an N-D shape.
pub fn rows_cols(name: &str, shape: &[usize]) -> Result<(usize, usize), String> {
    match shape.split_last() {
        Some((&cols, lead)) => Ok((lead.iter().product(), cols)),
        None => Err(format!("{name} is a scalar; expected an array of at least one dimension")),
    }
}

/// Checks that an array's 2-D view is [rows, cols] (any N-D shape with that view is accepted).
pub fn expect(name: &str, shape: &[usize], rows: usize, cols: usize) -> Result<(), String> {
    match rows_cols(name, shape)? {
        (r, c) if (r, c) == (rows, cols) => Ok(()),
        _ => Err(format!("{name} has shape {shape:?}; expected [{rows}, {cols}]")),
    }
}

/// Checks that an array holds exactly `len` values (per-row vectors may come as [rows] or [rows, 1]).
pub fn expect_len(name: &str, shape: &[usize], len: usize) -> Result<(), String> {
    if shape.iter().product::<usize>() == len && !shape.is_empty() {
        Ok(())
    } else {
        Err(format!("{name} has shape {shape:?}; expected {len} values"))
    }
}

/// Rows per parallel task: about 64K elements each, so thin matrices do not drown in scheduling overhead.
pub fn task_rows(cols: usize) -> usize {
    ((1 << 16) / cols.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_d_view() {
        assert_eq!(rows_cols("w", &[2, 3, 4]), Ok((6, 4)));
        assert_eq!(rows_cols("w", &[5]), Ok((1, 5)));
        assert_eq!(rows_cols("w", &[0, 8]), Ok((0, 8)));
        assert!(rows_cols("w", &[]).unwrap_err().contains("scalar"));
        assert!(expect("out", &[2, 3, 4], 6, 4).is_ok());
        assert!(expect("out", &[6, 5], 6, 4).unwrap_err().contains("[6, 5]"));
        assert!(expect_len("scales", &[6], 6).is_ok());
        assert!(expect_len("scales", &[7], 6).is_err());
    }
}
