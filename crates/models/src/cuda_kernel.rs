//! A custom CUDA kernel compiled by MLX's NVRTC path
//! (`mlx_fast_cuda_kernel`): source text over named inputs and outputs,
//! template arguments (ints and one dtype) in the compiled kernel's cache
//! key, launched as one MLX primitive (so it can sit inside a compiled
//! trace). Used by the paged decode attention and the fused decode kernels.

use std::ffi::CString;

use mlx_rs::{Array, Dtype};

use crate::error::{ModelError, Result};

/// One NVRTC kernel object.
pub(crate) struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: created by mlx_fast_cuda_kernel_new, freed once here.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

impl Kernel {
    pub(crate) fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str) -> Result<Self> {
        let ins = strings(inputs)?;
        let outs = strings(outputs)?;
        let name = CString::new(name).map_err(|e| ModelError::Invalid(e.to_string()))?;
        let source =
            CString::new(compact(source)).map_err(|e| ModelError::Invalid(e.to_string()))?;
        let header = CString::new("").expect("static header");
        // SAFETY: all arguments are live for the call; the vectors are freed
        // after it (MLX copied them).
        let kernel = unsafe {
            let k = mlx_sys::mlx_fast_cuda_kernel_new(
                name.as_ptr(),
                ins,
                outs,
                source.as_ptr(),
                header.as_ptr(),
                true,
                0,
            );
            mlx_sys::mlx_vector_string_free(ins);
            mlx_sys::mlx_vector_string_free(outs);
            k
        };
        if kernel.ctx.is_null() {
            return Err(ModelError::Invalid(
                "mlx_fast_cuda_kernel_new returned null".into(),
            ));
        }
        Ok(Self(kernel))
    }

    /// Launches the kernel over `inputs`: `outputs` are (shape, dtype), the
    /// grid and block are in threads, `ints` and `dtype` are template
    /// arguments (the dtype is part of the compiled kernel's cache key).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32),
        threads: i32,
        ints: &[(&str, i32)],
        dtype: (&str, Dtype),
    ) -> Result<Vec<Array>> {
        let names: Vec<CString> = ints
            .iter()
            .map(|(n, _)| CString::new(*n))
            .chain(std::iter::once(CString::new(dtype.0)))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| ModelError::Invalid(e.to_string()))?;
        let ptrs: Vec<mlx_sys::mlx_array> = inputs.iter().map(|a| a.as_ptr()).collect();
        // SAFETY: every handle is live for the call; the config and vectors
        // are freed before returning; outputs are taken over by `Array`s.
        unsafe {
            let cfg = mlx_sys::mlx_fast_cuda_kernel_config_new();
            for (shape, dt) in outputs {
                mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    cfg,
                    shape.as_ptr(),
                    shape.len(),
                    mlx_dtype(*dt),
                );
            }
            mlx_sys::mlx_fast_cuda_kernel_config_set_grid(cfg, grid.0, grid.1, 1);
            mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(cfg, threads, 1, 1);
            for ((_, v), n) in ints.iter().zip(&names) {
                mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(cfg, n.as_ptr(), *v);
            }
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                cfg,
                names[ints.len()].as_ptr(),
                mlx_dtype(dtype.1),
            );
            let inputs = mlx_sys::mlx_vector_array_new_data(ptrs.as_ptr(), ptrs.len());
            let mut outs = mlx_sys::mlx_vector_array_new();
            let stream = mlx_rs::Stream::thread_local_or_default();
            let rc = mlx_sys::mlx_fast_cuda_kernel_apply(
                &mut outs,
                self.0,
                inputs,
                cfg,
                stream.as_ptr(),
            );
            mlx_sys::mlx_vector_array_free(inputs);
            mlx_sys::mlx_fast_cuda_kernel_config_free(cfg);
            if rc != 0 {
                mlx_sys::mlx_vector_array_free(outs);
                return Err(ModelError::Invalid(
                    "mlx_fast_cuda_kernel_apply failed".into(),
                ));
            }
            let n = mlx_sys::mlx_vector_array_size(outs);
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                let mut a = mlx_sys::mlx_array_new();
                mlx_sys::mlx_vector_array_get(&mut a, outs, i);
                v.push(Array::from_ptr(a));
            }
            mlx_sys::mlx_vector_array_free(outs);
            Ok(v)
        }
    }
}

/// `source` without its comments, indentation and blank lines, for NVRTC the
/// same program. MLX CUDA hashes a custom kernel's whole source at every launch
/// (`CustomKernel::eval_gpu` names the module by `std::hash` of it), so the
/// text's length is host time in every step: a 4-bit tensor-core product's
/// source is ~14 KB as written and ~7 KB compacted, launched ~90 times a step.
/// Line breaks stay (preprocessor lines end at them); a `//` after a quote on
/// its line is left alone (it could be inside a string).
pub(crate) fn compact(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    for line in source.lines() {
        let code = match line.find("//") {
            Some(i) if !line[..i].contains('"') => &line[..i],
            _ => line,
        };
        let code = code.trim();
        if !code.is_empty() {
            out.push_str(code);
            out.push('\n');
        }
    }
    out
}

fn strings(names: &[&str]) -> Result<mlx_sys::mlx_vector_string> {
    // SAFETY: the vector is created here and returned to the caller, who frees
    // it; every appended C string outlives its append (MLX copies it).
    unsafe {
        let v = mlx_sys::mlx_vector_string_new();
        for n in names {
            let c = CString::new(*n).map_err(|e| ModelError::Invalid(e.to_string()))?;
            mlx_sys::mlx_vector_string_append_value(v, c.as_ptr());
        }
        Ok(v)
    }
}

fn mlx_dtype(d: Dtype) -> mlx_sys::mlx_dtype {
    match d {
        Dtype::Float32 => mlx_sys::mlx_dtype__MLX_FLOAT32,
        Dtype::Float16 => mlx_sys::mlx_dtype__MLX_FLOAT16,
        _ => mlx_sys::mlx_dtype__MLX_BFLOAT16,
    }
}

#[cfg(test)]
mod tests {
    use super::compact;

    #[test]
    fn compact_drops_comments_indentation_and_blank_lines_only() {
        let src = "// a kernel\n#define N 4 // rows\n\n    int x = 1;   \n  asm(\"mov.u32 %0, 1; // not a comment\");\n\t}\n";
        assert_eq!(
            compact(src),
            "#define N 4\nint x = 1;\nasm(\"mov.u32 %0, 1; // not a comment\");\n}\n"
        );
        assert_eq!(compact(&compact(src)), compact(src), "idempotent");
    }
}
