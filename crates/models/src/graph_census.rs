//! What a step's graph asks the device to run: MLX's DOT export of the
//! unevaluated outputs, counted by primitive. Each primitive node is (at
//! least) one kernel dispatch, which is what a small decode step's time is
//! made of on the GPU; benches and tests read the census to see what a change
//! adds or removes.

use std::collections::BTreeMap;
use std::io::Read;

use mlx_rs::Array;

use crate::error::{ModelError, Result};

extern "C" {
    fn tmpfile() -> *mut mlx_sys::FILE;
    fn fflush(f: *mut mlx_sys::FILE) -> i32;
    fn rewind(f: *mut mlx_sys::FILE);
    fn fgetc(f: *mut mlx_sys::FILE) -> i32;
    fn fclose(f: *mut mlx_sys::FILE) -> i32;
}

/// Primitive nodes of the graph that evaluating `outputs` would run, by
/// primitive name (e.g. `Matmul`, `Scatter`, `Compiled`); arrays already
/// evaluated count as inputs, not nodes.
pub fn census(outputs: &[Array]) -> Result<BTreeMap<String, usize>> {
    Ok(count_primitives(&dot(outputs)?))
}

/// MLX's DOT rendering of the graph behind `outputs`.
pub fn dot(outputs: &[Array]) -> Result<String> {
    let failed = |what: &str| ModelError::Invalid(format!("graph export: {what}"));
    // SAFETY: the vector and namer are created and freed here; the FILE is a
    // temporary opened, read and closed here.
    unsafe {
        let vec = mlx_sys::mlx_vector_array_new();
        for a in outputs {
            if mlx_sys::mlx_vector_array_append_value(vec, a.as_ptr()) != 0 {
                mlx_sys::mlx_vector_array_free(vec);
                return Err(failed("append"));
            }
        }
        let f = tmpfile();
        if f.is_null() {
            mlx_sys::mlx_vector_array_free(vec);
            return Err(failed("no temporary file"));
        }
        let namer = mlx_sys::mlx_node_namer_new();
        let rc = mlx_sys::mlx_export_to_dot(f, namer, vec);
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(vec);
        let mut out = Vec::new();
        if rc == 0 {
            fflush(f);
            rewind(f);
            loop {
                let c = fgetc(f);
                if c < 0 {
                    break;
                }
                out.push(c as u8);
            }
        }
        fclose(f);
        if rc != 0 {
            return Err(failed("mlx_export_to_dot failed"));
        }
        let mut s = String::new();
        out.as_slice()
            .read_to_string(&mut s)
            .map_err(|_| failed("not UTF-8"))?;
        Ok(s)
    }
}

/// Counts the primitive nodes of a DOT export: MLX draws them as
/// `{ id [label ="Name", shape=rectangle]; }` and arrays as ovals.
fn count_primitives(dot: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in dot.lines() {
        if !line.contains("shape=rectangle") {
            continue;
        }
        let Some(start) = line.find("label =\"").map(|i| i + 8) else {
            continue;
        };
        let Some(len) = line[start..].find('"') else {
            continue;
        };
        // Labels may carry parameters after the name ("Reduce Sum"): keep the name.
        let name = line[start..start + len]
            .split_whitespace()
            .next()
            .unwrap_or("?");
        *counts.entry(name.to_string()).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops;

    #[test]
    fn counts_the_primitives_an_evaluation_would_run() {
        let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
        let b = ops::add(&a, &a).unwrap();
        let c = ops::multiply(&b, &a).unwrap();
        let d = ops::add(&c, &b).unwrap();
        let n = census(&[d]).unwrap();
        assert_eq!(n.get("Add"), Some(&2), "{n:?}");
        assert_eq!(n.get("Multiply"), Some(&1), "{n:?}");
        assert_eq!(n.values().sum::<usize>(), 3, "{n:?}");
        // Evaluated arrays are inputs, not work.
        mlx_rs::transforms::eval([&c]).unwrap();
        let e = ops::add(&c, &a).unwrap();
        assert_eq!(census(&[e]).unwrap().values().sum::<usize>(), 1);
    }
}
