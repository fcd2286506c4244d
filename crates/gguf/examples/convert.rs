//! Converts a GGUF file: `cargo run -p weft-gguf --example convert -- MODEL.gguf OUT_DIR`.

use std::path::PathBuf;

fn main() {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [gguf, out] = args.as_slice() else {
        eprintln!("usage: convert MODEL.gguf OUT_DIR");
        std::process::exit(2);
    };
    if let Err(e) = weft_gguf::convert_gguf(gguf, out) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
