//! glibc malloc tuning for MLX's CPU backend.
//!
//! MLX allocates multi-MiB outputs every step (K/V writes, logits, gathers).
//! glibc serves those with fresh `mmap`s and returns them on free, so each
//! step page-faults and zeroes megabytes again (measured: ~13% of a 32-stream
//! decode run in `clear_page`, and 6 ms -> 40-50 ms for a B=32 paged read).
//! Raising the mmap and trim thresholds keeps those buffers in the heap.

/// Call first thing in `main`, before MLX allocates. No-op off glibc.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before other threads start.
    unsafe {
        // 32 MiB is glibc's maximum mmap threshold on 64-bit targets.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}
