// Test and bench binaries of this crate link libmlx; point them at it (see
// crates/mlx-sys/build.rs). LD_LIBRARY_PATH still overrides at run time.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
