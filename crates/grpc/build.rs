fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Binaries here link libmlx (see crates/mlx-sys/build.rs); LD_LIBRARY_PATH
    // still overrides this at run time (e.g. MLX's CUDA build).
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_build::configure()
        // Undecodable messages are INVALID_ARGUMENT, not INTERNAL (src/codec.rs).
        .codec_path("crate::codec::WeftCodec")
        .file_descriptor_set_path(out.join("weft_descriptor.bin"))
        .compile_protos(&["../../proto/weft/v1/weft.proto"], &["../../proto"])?;
    println!("cargo:rerun-if-changed=../../proto/weft/v1/weft.proto");
    Ok(())
}
