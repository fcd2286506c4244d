//! Fetches and converts the default model: `cargo run -p weft-gguf --example pull_default [CACHE_DIR]`.

use std::path::PathBuf;

fn main() {
    let cache = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(weft_gguf::default_cache_dir);
    match weft_gguf::pull_default(&cache, true) {
        Ok(dir) => println!("{}", dir.display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
