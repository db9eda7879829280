//! Python bindings only; the kernels live one file per family.
use pyo3::prelude::*;

#[pymodule]
fn rust_quant(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
