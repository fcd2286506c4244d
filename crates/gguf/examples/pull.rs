//! Fetches and converts a known model by name:
//! `cargo run -p weft-gguf --release --example pull [NAME] [CACHE_DIR]`
//! (`weft pull NAME` without building the server).

use std::path::PathBuf;

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_default();
    let cache = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(weft_gguf::default_cache_dir);
    let Some(model) = weft_gguf::find_model(&name) else {
        let known: Vec<&str> = weft_gguf::KNOWN_MODELS.iter().map(|m| m.name()).collect();
        eprintln!(
            "error: unknown model {name:?} (known: {})",
            known.join(", ")
        );
        std::process::exit(2);
    };
    match model.pull(&cache, true) {
        Ok(dir) => println!("{}", dir.display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
