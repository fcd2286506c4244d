//! Builds mlx-c on Linux against a prebuilt libmlx and generates the bindings
//! mlx-rs 0.33 expects from `mlx-sys 0.7.0`.
//!
//! Inputs are fetched from package registries, pinned by version and sha256:
//! - libmlx: the `mlx-cpu==0.32.4` wheel from PyPI (or any MLX install via
//!   `MLX_PREFIX=<dir with lib/libmlx.so, include/, share/cmake/MLX>`);
//! - mlx-c sources: the published `mlx-sys 0.7.0` crate from crates.io.
//!
//! Offline builds: `MLX_SYS_CRATE=<path to mlx-sys-0.7.0.crate>` and either
//! `MLX_CPU_WHEEL=<path to the wheel>` or `MLX_PREFIX`. Paths given this way are
//! checksummed like downloads.
//!
//! At run time the binary finds libmlx through an rpath to the build-time
//! library; `LD_LIBRARY_PATH` overrides it (e.g. MLX's CUDA build, same ABI).

use std::env;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

const MLX_SYS_CRATE_URL: &str = "https://static.crates.io/crates/mlx-sys/mlx-sys-0.7.0.crate";
const MLX_SYS_CRATE_SHA256: &str =
    "da965f83ce211b80f9b681d9bbd6fa625fe6bb2e659ba7bc55dd95eea8d3b028";
const MLX_CPU_WHEEL_URL: &str = "https://files.pythonhosted.org/packages/a4/0f/1f3e0d30ccae2f7e9cd270633f8fd79d470248c07be3d501cebf9271783f/mlx_cpu-0.32.4-py3-none-manylinux_2_35_x86_64.whl";
const MLX_CPU_WHEEL_SHA256: &str =
    "0e0a24fa2ce8b6b94d2e6a90604e8813aa8e29fcb918bb2aa01cfb6d133d8cee";

type BoxError = Box<dyn std::error::Error>;

fn main() {
    if let Err(e) = run() {
        panic!("mlx-sys build failed: {e}");
    }
}

fn run() -> Result<(), BoxError> {
    for var in ["MLX_PREFIX", "MLX_SYS_CRATE", "MLX_CPU_WHEEL"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(env::var("OUT_DIR")?);

    let prefix = match env::var_os("MLX_PREFIX") {
        Some(p) => PathBuf::from(p),
        None => {
            let wheel = obtain(
                env::var_os("MLX_CPU_WHEEL").map(PathBuf::from),
                MLX_CPU_WHEEL_URL,
                MLX_CPU_WHEEL_SHA256,
                &out.join("mlx_cpu-0.32.4.whl"),
            )?;
            let dest = out.join("mlx-wheel");
            if !dest.join(".complete").exists() {
                unzip(&wheel, &dest)?;
                fs::write(dest.join(".complete"), b"")?;
            }
            dest.join("mlx")
        }
    };
    let lib_dir = prefix.join("lib");
    let cmake_dir = prefix.join("share/cmake/MLX");
    for needed in [lib_dir.join("libmlx.so"), cmake_dir.join("MLXConfig.cmake")] {
        if !needed.exists() {
            return Err(format!(
                "MLX install at {} lacks {}",
                prefix.display(),
                needed.display()
            )
            .into());
        }
    }

    let mlx_c = out.join("mlx-c");
    if !mlx_c.join(".complete").exists() {
        let krate = obtain(
            env::var_os("MLX_SYS_CRATE").map(PathBuf::from),
            MLX_SYS_CRATE_URL,
            MLX_SYS_CRATE_SHA256,
            &out.join("mlx-sys-0.7.0.crate"),
        )?;
        if mlx_c.exists() {
            fs::remove_dir_all(&mlx_c)?;
        }
        untar_subdir(&krate, "mlx-sys-0.7.0/src/mlx-c/", &mlx_c)?;
        patch_for_linux(&mlx_c)?;
        fs::write(mlx_c.join(".complete"), b"")?;
    }

    let dst = cmake::Config::new(&mlx_c)
        .profile("Release")
        .define("MLX_C_USE_SYSTEM_MLX", "ON")
        .define("MLX_DIR", &cmake_dir)
        .define("MLX_C_BUILD_EXAMPLES", "OFF")
        .define("BUILD_SHARED_LIBS", "OFF")
        .build();
    for sub in ["lib", "lib64"] {
        println!("cargo:rustc-link-search=native={}", dst.join(sub).display());
    }
    println!("cargo:rustc-link-lib=static=mlxc");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    // Dependents read these as DEP_MLX_LIB_DIR / DEP_MLX_PREFIX to add an rpath.
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:prefix={}", prefix.display());

    let mut builder = bindgen::Builder::default()
        .rust_target("1.73.0".parse()?)
        .clang_arg(format!("-I{}", mlx_c.display()))
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        // mlx-rs reads `float16_t` as a one-field tuple struct (what bindgen
        // makes of ARM's __fp16); x86 headers declare a plain uint16_t.
        .blocklist_type("float16_t")
        .raw_line(
            "#[repr(transparent)]\n#[derive(Debug, Default, Copy, Clone, PartialEq)]\npub struct float16_t(pub u16);",
        );
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    headers.sort();
    for h in &headers {
        builder = builder.header(h.to_string_lossy());
    }
    builder
        .generate()
        .map_err(|e| format!("bindgen: {e}"))?
        .write_to_file(out.join("bindings.rs"))?;
    Ok(())
}

/// Returns a verified local copy of a pinned input: the given path, or a download.
fn obtain(
    given: Option<PathBuf>,
    url: &str,
    sha256: &str,
    dest: &Path,
) -> Result<PathBuf, BoxError> {
    let path = match given {
        Some(p) => p,
        None => {
            if !dest.exists() || sha256_of(dest)? != sha256 {
                let resp = ureq::get(url)
                    .call()
                    .map_err(|e| format!("download {url}: {e}"))?;
                let mut body = Vec::new();
                resp.into_reader().read_to_end(&mut body)?;
                let tmp = dest.with_extension("part");
                fs::File::create(&tmp)?.write_all(&body)?;
                fs::rename(&tmp, dest)?;
            }
            dest.to_path_buf()
        }
    };
    let got = sha256_of(&path)?;
    if got != sha256 {
        return Err(format!("{}: sha256 {got}, expected {sha256}", path.display()).into());
    }
    Ok(path)
}

fn sha256_of(path: &Path) -> Result<String, BoxError> {
    let mut h = Sha256::new();
    let mut f = fs::File::open(path)?;
    std::io::copy(&mut f, &mut h)?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn unzip(archive: &Path, dest: &Path) -> Result<(), BoxError> {
    let mut zip = zip::ZipArchive::new(fs::File::open(archive)?)?;
    zip.extract(dest)?;
    Ok(())
}

fn untar_subdir(archive: &Path, prefix: &str, dest: &Path) -> Result<(), BoxError> {
    let gz = flate2::read::GzDecoder::new(fs::File::open(archive)?);
    let mut tar = tar::Archive::new(gz);
    for entry in tar.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.to_string_lossy().into_owned();
        if let Some(rel) = path.strip_prefix(prefix) {
            if rel.is_empty() || rel.contains("..") {
                continue;
            }
            let target = dest.join(rel);
            if let Some(parent) = target.parent() {
                fs::create_dir_all(parent)?;
            }
            entry.unpack(&target)?;
        }
    }
    Ok(())
}

fn replace_once(path: &Path, from: &str, to: &str) -> Result<(), BoxError> {
    let text = fs::read_to_string(path)?;
    if !text.contains(from) {
        return Err(format!("patch target not found in {}: {from:?}", path.display()).into());
    }
    fs::write(path, text.replacen(from, to, 1))?;
    Ok(())
}

/// mlx-c 0.7.0 targets macOS's clang and MLX 0.32.2; three spots need changing
/// for GCC 12 and MLX 0.32.4 headers.
fn patch_for_linux(root: &Path) -> Result<(), BoxError> {
    // 1. GCC 12's libstdc++ has no std::format: a minimal "{}" formatter.
    let io_h = root.join("mlx/c/private/io.h");
    let text = fs::read_to_string(&io_h)?;
    let shim = r#"#include <sstream>
#include <string>
namespace mlx_c_linux {
inline void fmt_rest(std::ostringstream& os, const char* f) { os << f; }
template <typename T, typename... R>
void fmt_rest(std::ostringstream& os, const char* f, const T& v, const R&... r) {
  for (; *f; ++f) {
    if (f[0] == '{' && f[1] == '}') { os << v; fmt_rest(os, f + 2, r...); return; }
    os << *f;
  }
}
template <typename... A>
std::string format(const char* f, const A&... a) {
  std::ostringstream os; fmt_rest(os, f, a...); return os.str();
}
} // namespace mlx_c_linux
#include "mlx/mlx.h"
"#;
    if !text.contains("#include \"mlx/mlx.h\"") {
        return Err("io.h: include anchor not found".into());
    }
    let text = text
        .replacen("#include \"mlx/mlx.h\"\n", shim, 1)
        .replace("std::format(", "mlx_c_linux::format(");
    fs::write(&io_h, text)?;

    // 2. MLX 0.32.4's gather_qmm gained `global_scale` before `sorted_indices`.
    let ops = root.join("mlx/c/ops.cpp");
    let text = fs::read_to_string(&ops)?;
    let start = text
        .find("extern \"C\" int mlx_gather_qmm(")
        .ok_or("ops.cpp: mlx_gather_qmm not found")?;
    let anchor = "std::string(mode),\n            sorted_indices,";
    let rel = text[start..]
        .find(anchor)
        .ok_or("ops.cpp: gather_qmm call anchor not found")?;
    let mut patched = text.clone();
    patched.replace_range(
        start + rel..start + rel + anchor.len(),
        "std::string(mode),\n            std::nullopt,\n            sorted_indices,",
    );
    fs::write(&ops, patched)?;

    // 3. Off ARM, half.h declares no 16-bit float types, which hides the
    //    float16/bfloat16 accessors mlx-rs calls. Only pointers cross the C ABI,
    //    so 16-bit storage types are enough.
    replace_once(
        &root.join("mlx/c/half.h"),
        "#ifdef __cplusplus\n}\n#endif",
        "#if !defined(HAS_FLOAT16)\n#include <stdint.h>\n#define HAS_FLOAT16\ntypedef uint16_t float16_t;\n#endif\n\
#if !defined(HAS_BFLOAT16)\n#include <stdint.h>\n#define HAS_BFLOAT16\ntypedef uint16_t bfloat16_t;\n#endif\n\n#ifdef __cplusplus\n}\n#endif",
    )?;
    Ok(())
}
