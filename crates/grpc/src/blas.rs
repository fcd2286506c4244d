//! Optional OpenBLAS for CPU runs.
//!
//! MLX's CPU wheel routes f32 matmuls to a slow reference BLAS; Debian's
//! OpenBLAS is 30-50x faster on the same calls. Interposing it needs the
//! library loaded before libmlx resolves `cblas_sgemm`, i.e. `LD_PRELOAD`, so
//! the binary re-executes itself once with it set when the library exists.
//! Machines without it (GPU hosts) run unchanged; `WEFT_OPENBLAS=0` opts out,
//! `WEFT_OPENBLAS=<path>` picks another library.

use std::ffi::OsString;
use std::path::PathBuf;

const CANDIDATES: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
];
const MARKER: &str = "WEFT_OPENBLAS_ACTIVE";

/// Re-executes the current process with OpenBLAS preloaded when that helps.
/// Returns only if no re-exec happened.
pub fn maybe_reexec_with_openblas() {
    if std::env::var_os(MARKER).is_some() {
        return;
    }
    let chosen = match std::env::var("WEFT_OPENBLAS") {
        Ok(v) if v == "0" || v.is_empty() => return,
        Ok(v) => Some(PathBuf::from(v)),
        Err(_) => CANDIDATES.iter().map(PathBuf::from).find(|p| p.exists()),
    };
    let Some(lib) = chosen.filter(|p| p.exists()) else {
        return;
    };
    let mut preload = OsString::from(lib.as_os_str());
    if let Some(existing) = std::env::var_os("LD_PRELOAD") {
        preload.push(":");
        preload.push(existing);
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    use std::os::unix::process::CommandExt;
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_PRELOAD", preload)
        .env(MARKER, lib.as_os_str())
        .exec();
    // exec only returns on failure: carry on without OpenBLAS.
    tracing::warn!(error = %err, "could not re-exec with OpenBLAS; continuing without it");
}

/// The preloaded BLAS, if any (for logs and benchmark reports).
pub fn active() -> Option<String> {
    std::env::var(MARKER).ok()
}
