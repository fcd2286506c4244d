//! Parallel CPU evaluation lanes for one engine step.
//!
//! MLX's CPU backend runs every op of a stream on that stream's one thread,
//! and only BLAS calls fan out to more cores. On a prefill a third of the
//! wall time is elementwise work (norms, RoPE, SiLU, softmax) during which the
//! other cores only spin in BLAS's idle loop. Independent forwards of a step
//! (the halves of a prefill group, a chunk beside the decode batch) can
//! instead be built on separate CPU streams: MLX evaluates them concurrently,
//! each lane's BLAS calls single-threaded, so every core does useful work all
//! the time (a `[16, 128]` prefill on 2 cores: 3.6 s -> 3.05 s).
//!
//! A pure decode step stays on one lane with multi-threaded BLAS: its matmuls
//! are bound by reading the weights, and two lanes would read them twice.

use mlx_rs::{Device, Stream};

/// Token-rows a lane must carry before splitting a step pays for the second
/// stream's synchronisation and the weights read twice (measured: a 4-row
/// decode per lane is slower than one 8-row decode; 4 x 128 prefill rows per
/// lane are faster).
pub const MIN_PARALLEL_TOKENS: usize = 256;

pub struct Lanes {
    streams: Vec<Stream>,
    blas: Option<BlasThreads>,
    min_tokens: usize,
}

impl Lanes {
    /// `n` lanes (at least one) on the CPU.
    pub fn cpu(n: usize) -> Self {
        let mut streams = vec![Stream::cpu()];
        for _ in 1..n.max(1) {
            streams.push(Stream::new_with_device(&Device::cpu()));
        }
        Self {
            streams,
            blas: BlasThreads::find(),
            min_tokens: MIN_PARALLEL_TOKENS,
        }
    }

    /// One lane, the default stream: what runs on a GPU, where MLX already
    /// keeps the device busy.
    pub fn single() -> Self {
        Self {
            streams: vec![],
            blas: None,
            min_tokens: MIN_PARALLEL_TOKENS,
        }
    }

    /// As many lanes as cores, up to 2 (more lanes would split a prefill into
    /// thinner batches for no core to spare).
    pub fn auto_cpu() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::cpu(cores.min(2))
    }

    /// Sets the token-rows each of two lanes must carry for a step to split
    /// (tests use 1 to split the small steps of a tiny model).
    pub fn with_min_tokens(mut self, n: usize) -> Self {
        self.min_tokens = n.max(1);
        self
    }

    pub fn count(&self) -> usize {
        self.streams.len().max(1)
    }

    pub fn min_tokens(&self) -> usize {
        self.min_tokens
    }

    /// Runs `f` building its graph on lane `i`.
    pub fn on<T>(&self, i: usize, f: impl FnOnce() -> T) -> T {
        match self.streams.get(i) {
            Some(s) if self.streams.len() > 1 => mlx_rs::with_stream(s, f),
            _ => f(),
        }
    }

    /// While the guard lives, BLAS calls run on their caller's thread, so
    /// lanes evaluating at once do not oversubscribe the cores.
    pub fn single_threaded_blas(&self) -> Option<BlasGuard> {
        self.blas.as_ref().and_then(BlasThreads::single)
    }
}

/// Holds OpenBLAS (when loaded) at one thread for the rest of the process.
/// With the packed GEMM ([`crate::cpu_gemm`]) BLAS only sees attention's small
/// products, and an idle OpenBLAS worker spins in `sched_yield` for a while
/// after each, taking a core from the GEMM threads (measured: a `[8, 128]`
/// prefill 1.68-1.85 s -> 1.63-1.64 s).
pub fn single_threaded_blas_for_good() {
    if let Some(b) = BlasThreads::find() {
        // SAFETY: OpenBLAS's thread-count call, made while no BLAS call runs
        // (at model load, before any step).
        unsafe { (b.set)(1) };
    }
}

/// Assigns jobs (by cost) to `lanes`, largest first onto the least loaded
/// lane. Ties go to the lower lane, so the same step always gets the same plan.
pub fn assign(costs: &[usize], lanes: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; lanes.max(1)];
    let mut out = vec![0; costs.len()];
    for j in order {
        let lane = (0..load.len()).min_by_key(|&l| (load[l], l)).unwrap_or(0);
        load[lane] += costs[j];
        out[j] = lane;
    }
    out
}

/// OpenBLAS's thread-count controls, when OpenBLAS is the BLAS loaded.
struct BlasThreads {
    get: unsafe extern "C" fn() -> i32,
    set: unsafe extern "C" fn(i32),
}

impl BlasThreads {
    fn find() -> Option<Self> {
        #[cfg(unix)]
        // SAFETY: dlsym with RTLD_DEFAULT only looks symbols up; the two
        // OpenBLAS functions have exactly these C signatures.
        unsafe {
            let get = libc::dlsym(libc::RTLD_DEFAULT, c"openblas_get_num_threads".as_ptr());
            let set = libc::dlsym(libc::RTLD_DEFAULT, c"openblas_set_num_threads".as_ptr());
            if get.is_null() || set.is_null() {
                return None;
            }
            Some(Self {
                get: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn() -> i32>(get),
                set: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(i32)>(set),
            })
        }
        #[cfg(not(unix))]
        None
    }

    fn single(&self) -> Option<BlasGuard> {
        // SAFETY: OpenBLAS's thread-count calls; no BLAS call is in flight
        // between steps, which is the only place the engine thread calls this.
        let before = unsafe { (self.get)() };
        if before <= 1 {
            return None;
        }
        unsafe { (self.set)(1) };
        Some(BlasGuard {
            set: self.set,
            restore: before,
        })
    }
}

/// Restores BLAS's thread count on drop.
pub struct BlasGuard {
    set: unsafe extern "C" fn(i32),
    restore: i32,
}

impl Drop for BlasGuard {
    fn drop(&mut self) {
        // SAFETY: see `BlasThreads::single`.
        unsafe { (self.set)(self.restore) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assign_balances_largest_first() {
        // 8 + 2 on one lane, 5 + 4 on the other.
        assert_eq!(assign(&[2, 8, 5, 4], 2), vec![0, 0, 1, 1]);
        assert_eq!(assign(&[3, 3], 2), vec![0, 1]);
        assert_eq!(assign(&[3, 3], 1), vec![0, 0]);
        assert_eq!(assign(&[], 2), Vec::<usize>::new());
    }

    /// The guard drops OpenBLAS to one thread and restores the count. Needs
    /// Debian's OpenBLAS (scripts/setup.sh installs it); loaded here the way
    /// `weft` preloads it, into the global symbol scope.
    #[test]
    fn blas_guard_goes_single_threaded_and_restores() {
        let path = c"/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0";
        // SAFETY: loading a shared library; OpenBLAS has no unsafe constructors.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
            panic!("OpenBLAS missing: run scripts/setup.sh");
            #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
            return;
        }
        let blas = BlasThreads::find().expect("OpenBLAS symbols after dlopen");
        // SAFETY: OpenBLAS's own thread-count calls.
        let get = || unsafe { (blas.get)() };
        unsafe { (blas.set)(2) };
        assert_eq!(get(), 2);
        let guard = blas.single().expect("two threads to drop from");
        assert_eq!(get(), 1);
        drop(guard);
        assert_eq!(get(), 2);
        // Already single-threaded: nothing to change or restore.
        unsafe { (blas.set)(1) };
        assert!(blas.single().is_none());
        unsafe { (blas.set)(2) };
    }
}
