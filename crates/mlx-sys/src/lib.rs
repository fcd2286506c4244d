//! Raw bindings to mlx-c, generated at build time (see `build.rs`).
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// mlx-rs's `RandomState::new` seeds from `mach_approximate_time`, a macOS-only
/// symbol; Linux links fail without it. Any monotonic nanosecond clock serves.
#[cfg(not(target_os = "macos"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    // Never 0: callers treat the value as a seed.
    start.elapsed().as_nanos() as u64 + 1
}
