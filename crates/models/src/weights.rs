//! Reads every `*.safetensors` file of a model directory (mmap) into MLX arrays.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::Array;
use safetensors::SafeTensors;

use crate::error::{ModelError, Result};

/// Tensors by name; `take` removes them so leftovers can be reported.
pub struct Weights {
    tensors: HashMap<String, Array>,
}

impl Weights {
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::Io {
                path: dir.to_path_buf(),
                source: e,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Weights(format!(
                "no *.safetensors files in {}",
                dir.display()
            )));
        }
        let mut tensors = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|e| ModelError::Io {
                path: path.clone(),
                source: e,
            })?;
            // SAFETY: the map is read-only and dropped before returning; arrays
            // copy their bytes out of it.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::Io {
                path: path.clone(),
                source: e,
            })?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?;
            for (name, view) in st.tensors() {
                let array = Array::try_from(view).map_err(|e| ModelError::Tensor {
                    name: name.clone(),
                    message: e.to_string(),
                })?;
                tensors.insert(name, array);
            }
        }
        Ok(Self { tensors })
    }

    pub fn from_map(tensors: HashMap<String, Array>) -> Self {
        Self { tensors }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn take(&mut self, name: &str) -> Result<Array> {
        self.tensors.remove(name).ok_or_else(|| ModelError::Tensor {
            name: name.to_string(),
            message: "missing from the model's safetensors files".into(),
        })
    }

    pub fn take_opt(&mut self, name: &str) -> Option<Array> {
        self.tensors.remove(name)
    }

    /// Renames every tensor by `f` (None drops it).
    pub fn rename(&mut self, f: impl Fn(&str) -> Option<String>) {
        let old = std::mem::take(&mut self.tensors);
        self.tensors = old
            .into_iter()
            .filter_map(|(n, a)| f(&n).map(|n| (n, a)))
            .collect();
    }

    /// Puts depthwise convolution weights stored `[C, 1, K]` (Hugging Face's
    /// layout) into MLX's `[C, K, 1]`; true when any was converted.
    pub fn convert_conv1d(&mut self) -> Result<bool> {
        let mut converted = false;
        for (name, a) in self.tensors.iter_mut() {
            if name.ends_with("conv1d.weight") && a.ndim() == 3 && a.shape()[2] != 1 {
                *a = a.swap_axes(1, 2)?;
                converted = true;
            }
        }
        Ok(converted)
    }

    pub fn remaining(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }
}
