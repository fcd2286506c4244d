//! Where Weft keeps downloaded and converted models.

use std::path::PathBuf;

/// `$WEFT_HOME`, else the converter's default (`$WEFT_CACHE_DIR`,
/// `$XDG_CACHE_HOME/weft`, `~/.cache/weft`).
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("WEFT_HOME") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => weft_gguf::default_cache_dir(),
    }
}
