//! Weight-stationary f32 GEMM for dense linear layers on the CPU.
//!
//! MLX's CPU backend hands every matmul to `cblas_sgemm`, and OpenBLAS packs
//! the whole weight matrix into its kernel's layout on every call. A decode
//! step multiplies a few rows by every weight of the model once, so that
//! packing (a read and a write of each weight, on a machine whose writes are
//! slow) costs about as much as the product itself: 8 rows through all of
//! SmolLM2-135M's linears took ~50 ms in MLX + OpenBLAS and 20 ms here, where
//! the weights are packed once at load and each call only streams them.
//!
//! Layout: output features in blocks of [`COLS`]; a block stores its weights
//! k-major (`[k][COLS]`), so the micro-kernel reads one contiguous run per
//! block while every row of `x` reuses it from L1/L2. Threads split the
//! blocks, so no two threads write the same output element and each output
//! is one sequential dot product over k (deterministic, and independent of
//! the thread count and of the other rows in the batch).

use std::sync::OnceLock;

/// Output features per packed block: three 16-lane AVX-512 vectors, six
/// 8-lane AVX2 ones.
pub const COLS: usize = 48;

/// A `[n, k]` weight matrix packed for [`PackedWeight::matmul`].
pub struct PackedWeight {
    n: usize,
    k: usize,
    store: Store,
}

enum Store {
    /// `blocks * k * COLS` floats; the last block's missing columns are 0.
    F32(Vec<f32>),
    /// MLX affine quantization kept quantized: `w = q * scale + bias` per
    /// group of `group` inputs. One byte per weight (`blocks * k * COLS`, the
    /// f32 layout's order); scales and biases `blocks * (k / group) * COLS`.
    Affine {
        q: Vec<u8>,
        scales: Vec<f32>,
        biases: Vec<f32>,
        group: usize,
    },
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedWeight[{}, {}]", self.n, self.k)
    }
}

/// The instruction set the kernels run with, detected once per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Portable,
}

impl Isa {
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }

    /// Whether the packed GEMM beats BLAS here (the portable loop does not).
    pub fn is_vectorized(self) -> bool {
        self != Isa::Portable
    }
}

impl PackedWeight {
    /// Packs row-major `w` (`[n, k]`, one row per output feature).
    pub fn pack(w: &[f32], n: usize, k: usize) -> PackedWeight {
        assert_eq!(
            w.len(),
            n * k,
            "weight of {} floats is not [{n}, {k}]",
            w.len()
        );
        let blocks = n.div_ceil(COLS);
        let mut data = vec![0f32; blocks * k * COLS];
        for (b, block) in data.chunks_exact_mut(k * COLS).enumerate() {
            for j in 0..COLS.min(n - b * COLS) {
                let row = &w[(b * COLS + j) * k..][..k];
                for (kk, &v) in row.iter().enumerate() {
                    block[kk * COLS + j] = v;
                }
            }
        }
        PackedWeight {
            n,
            k,
            store: Store::F32(data),
        }
    }

    /// Packs an MLX affine-quantized matrix as it is stored: `wq` `[n, k *
    /// bits / 32]` words (low bits first), `scales`/`biases` `[n, k / group]`.
    /// 2, 4 and 8 bits; `group` must divide `k`.
    pub fn pack_affine(
        wq: &[u32],
        scales: &[f32],
        biases: &[f32],
        n: usize,
        k: usize,
        group: usize,
        bits: usize,
    ) -> Result<PackedWeight, String> {
        if !matches!(bits, 2 | 4 | 8) || group == 0 || !k.is_multiple_of(group) {
            return Err(format!(
                "{bits}-bit groups of {group} over {k} inputs cannot be packed (2, 4 or 8 bits; groups dividing the input)"
            ));
        }
        let (per_word, words) = (32 / bits, k * bits / 32);
        let groups = k / group;
        if wq.len() != n * words || scales.len() != n * groups || biases.len() != n * groups {
            return Err(format!(
                "quantized [{n}, {k}] weight has {} words and {} / {} scales / biases",
                wq.len(),
                scales.len(),
                biases.len()
            ));
        }
        let blocks = n.div_ceil(COLS);
        let mask = (1u32 << bits) - 1;
        let mut q = vec![0u8; blocks * k * COLS];
        let mut sc = vec![0f32; blocks * groups * COLS];
        let mut bi = vec![0f32; blocks * groups * COLS];
        for col in 0..n {
            let (b, j) = (col / COLS, col % COLS);
            let row = &wq[col * words..][..words];
            for kk in 0..k {
                let word = row[kk / per_word];
                let v = (word >> ((kk % per_word) * bits)) & mask;
                q[(b * k + kk) * COLS + j] = v as u8;
            }
            for g in 0..groups {
                sc[(b * groups + g) * COLS + j] = scales[col * groups + g];
                bi[(b * groups + g) * COLS + j] = biases[col * groups + g];
            }
        }
        Ok(PackedWeight {
            n,
            k,
            store: Store::Affine {
                q,
                scales: sc,
                biases: bi,
                group,
            },
        })
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn in_features(&self) -> usize {
        self.k
    }

    fn blocks(&self) -> usize {
        self.n.div_ceil(COLS)
    }

    /// `y = x · wᵀ` for row-major `x` `[m, k]` into row-major `y` `[m, n]`,
    /// on the shared CPU pool.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_with(Isa::detect(), x, m, y)
    }

    /// As [`Self::matmul`] with a chosen instruction set (tests compare them).
    pub fn matmul_with(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32]) {
        assert_eq!(x.len(), m * self.k, "x is not [{m}, {}]", self.k);
        assert_eq!(y.len(), m * self.n, "y is not [{m}, {}]", self.n);
        if m == 0 || self.n == 0 {
            return;
        }
        let isa = match isa {
            Isa::Portable => Isa::Portable,
            // Never run an instruction set the CPU lacks.
            wanted if Isa::detect() == Isa::Avx512 || wanted == Isa::detect() => wanted,
            _ => Isa::detect(),
        };
        let blocks = self.blocks();
        let out = SharedOut(y.as_mut_ptr());
        let run = |range: std::ops::Range<usize>| {
            for b in range {
                // SAFETY: block b writes only columns [b*COLS, b*COLS+COLS) of
                // y's m rows, inside y (checked above); ranges are disjoint.
                unsafe { self.block(isa, b, x, m, out.get()) }
            }
        };
        let Some(pool) = pool() else {
            run(0..blocks);
            return;
        };
        let threads = pool.current_num_threads();
        // Below ~100k multiply-adds the pool's wake-up costs more than it saves.
        if threads <= 1 || blocks == 1 || m * self.n * self.k < 100_000 {
            run(0..blocks);
            return;
        }
        // A few tasks per thread, taken as threads come free: another lane's
        // MLX work may hold one core for part of the call.
        let tasks = (threads * 4).min(blocks);
        let per = blocks.div_ceil(tasks);
        pool.scope(|s| {
            for start in (0..blocks).step_by(per) {
                let range = start..(start + per).min(blocks);
                s.spawn(move |_| run(range));
            }
        });
    }

    /// Computes block `b` of `y` for all `m` rows.
    ///
    /// # Safety
    /// `y` points at a row-major `[m, n]` buffer no other thread writes
    /// block `b` of; `x` is `[m, k]`.
    unsafe fn block(&self, isa: Isa, b: usize, x: &[f32], m: usize, y: *mut f32) {
        let rows = Rows {
            x: x.as_ptr(),
            k: self.k,
            y: y.add(b * COLS),
            ldy: self.n,
            cols: COLS.min(self.n - b * COLS),
        };
        match &self.store {
            Store::F32(data) => {
                let w = &data[b * self.k * COLS..][..self.k * COLS];
                f32_block(isa, &Tile { w, rows }, m)
            }
            Store::Affine {
                q,
                scales,
                biases,
                group,
            } => {
                let groups = self.k / group;
                let tile = AffineTile {
                    q: &q[b * self.k * COLS..][..self.k * COLS],
                    scales: &scales[b * groups * COLS..][..groups * COLS],
                    biases: &biases[b * groups * COLS..][..groups * COLS],
                    group: *group,
                    rows,
                };
                affine_block(isa, &tile, m)
            }
        }
    }
}

/// # Safety
/// `tile` covers `m` rows of `x` and `y` (see [`PackedWeight::block`]).
unsafe fn f32_block(isa: Isa, tile: &Tile, m: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::block_avx512(tile, m),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::block_avx2(tile, m),
        _ => block_portable(tile, m),
    }
}

/// # Safety
/// As [`f32_block`].
unsafe fn affine_block(isa: Isa, tile: &AffineTile, m: usize) {
    if m <= AFFINE_FUSED_ROWS {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::affine_avx512(tile, m),
            _ => affine_portable(tile, m),
        }
        return;
    }
    // More rows than one fused pass: dequantize the block once and run the
    // f32 kernel over all of them (a prefill would otherwise dequantize it
    // again for every group of rows).
    SCRATCH.with_borrow_mut(|w| {
        w.clear();
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                w.resize(tile.rows.k * COLS, 0.0);
                x86::dequantize_avx512(tile, w);
            }
            _ => w.extend((0..tile.rows.k).flat_map(|kk| tile.weights(kk))),
        }
        // SAFETY: the same rows, over the dequantized block.
        unsafe { f32_block(isa, &Tile { w, rows: tile.rows }, m) }
    });
}

/// Rows of `x` and the output block they fill.
#[derive(Clone, Copy)]
struct Rows {
    /// The first row of `x` (row-major, `k` floats per row).
    x: *const f32,
    k: usize,
    /// The block's first column in the first row of `y`.
    y: *mut f32,
    /// Floats per row of `y`.
    ldy: usize,
    /// Columns of the block that exist (the last block may be partial).
    cols: usize,
}

impl Rows {
    /// The same block for rows `r..` of `x` and `y`.
    ///
    /// # Safety
    /// Row `r` exists in both.
    unsafe fn at_row(self, r: usize) -> Rows {
        Rows {
            x: self.x.add(r * self.k),
            y: self.y.add(r * self.ldy),
            ..self
        }
    }

    /// Input `kk` of row `r`.
    ///
    /// # Safety
    /// Row `r` exists; `kk < k`.
    unsafe fn x(self, r: usize, kk: usize) -> f32 {
        *self.x.add(r * self.k + kk)
    }

    /// Writes one row of finished accumulators (`COLS` lanes) to row `r`.
    ///
    /// # Safety
    /// Row `r` of `y` exists.
    unsafe fn store(self, r: usize, row: &[f32; COLS]) {
        std::ptr::copy_nonoverlapping(row.as_ptr(), self.y.add(r * self.ldy), self.cols);
    }
}

/// One packed f32 block against some rows of `x`.
#[derive(Clone, Copy)]
struct Tile<'a> {
    /// The block's weights, `[k][COLS]`.
    w: &'a [f32],
    rows: Rows,
}

/// Rows up to which a quantized block is dequantized inside the kernel; above
/// it, once into [`SCRATCH`].
const AFFINE_FUSED_ROWS: usize = 8;

thread_local! {
    /// A dequantized block (`k * COLS` floats), reused by each GEMM thread.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One quantized block against some rows of `x`.
#[derive(Clone, Copy)]
struct AffineTile<'a> {
    /// `[k][COLS]` quantized values.
    q: &'a [u8],
    /// `[k / group][COLS]` each.
    scales: &'a [f32],
    biases: &'a [f32],
    group: usize,
    rows: Rows,
}

impl AffineTile<'_> {
    /// The weights of input `kk` for the block's columns, dequantized.
    fn weights(&self, kk: usize) -> [f32; COLS] {
        let g = kk / self.group;
        let q = &self.q[kk * COLS..][..COLS];
        let (s, b) = (
            &self.scales[g * COLS..][..COLS],
            &self.biases[g * COLS..][..COLS],
        );
        std::array::from_fn(|j| (q[j] as f32).mul_add(s[j], b[j]))
    }
}

/// # Safety
/// As [`f32_block`].
unsafe fn affine_portable(t: &AffineTile, m: usize) {
    for r in 0..m {
        let mut acc = [0f32; COLS];
        for kk in 0..t.rows.k {
            let xv = t.rows.x(r, kk);
            for (a, wv) in acc.iter_mut().zip(t.weights(kk)) {
                *a = wv.mul_add(xv, *a);
            }
        }
        t.rows.store(r, &acc);
    }
}

/// The output pointer, shared by threads that write disjoint blocks of it.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: see `PackedWeight::block`: writers never overlap.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
impl SharedOut {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// One pool for every GEMM of the process, a thread per core (the engine
/// thread waits on it; MLX's stream threads run other lanes' ops meanwhile).
/// None if no thread could be started: GEMMs then run on the caller.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores)
            .thread_name(|i| format!("weft-gemm-{i}"))
            .build()
            .map_err(|e| tracing::warn!("GEMM threads unavailable, running on the caller: {e}"))
            .ok()
    })
    .as_ref()
}

/// # Safety
/// As [`f32_block`].
unsafe fn block_portable(t: &Tile, m: usize) {
    for r in 0..m {
        let mut acc = [0f32; COLS];
        for kk in 0..t.rows.k {
            let (xv, wk) = (t.rows.x(r, kk), &t.w[kk * COLS..][..COLS]);
            for (a, &wv) in acc.iter_mut().zip(wk) {
                *a = wv.mul_add(xv, *a);
            }
        }
        t.rows.store(r, &acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{AffineTile, Tile, COLS};
    use std::arch::x86_64::*;

    /// Rows of `x` one AVX-512 pass keeps in registers: 8 rows x 3 vectors
    /// = 24 accumulators of the 32 registers.
    const ROWS_512: usize = 8;
    /// AVX2 has 16 registers: 2 rows x 6 vectors = 12 accumulators.
    const ROWS_256: usize = 2;

    /// # Safety
    /// AVX-512F available; `t` covers `m` rows.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn block_avx512(t: &Tile, m: usize) {
        for r in (0..m).step_by(ROWS_512) {
            let t = Tile {
                rows: t.rows.at_row(r),
                ..*t
            };
            match m - r {
                1 => rows_avx512::<1>(&t),
                2 => rows_avx512::<2>(&t),
                3 => rows_avx512::<3>(&t),
                4 => rows_avx512::<4>(&t),
                5 => rows_avx512::<5>(&t),
                6 => rows_avx512::<6>(&t),
                7 => rows_avx512::<7>(&t),
                _ => rows_avx512::<ROWS_512>(&t),
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn rows_avx512<const M: usize>(t: &Tile) {
        let mut acc = [[_mm512_setzero_ps(); 3]; M];
        for kk in 0..t.rows.k {
            let wk = t.w.as_ptr().add(kk * COLS);
            let w0 = _mm512_loadu_ps(wk);
            let w1 = _mm512_loadu_ps(wk.add(16));
            let w2 = _mm512_loadu_ps(wk.add(32));
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(t.rows.x(r, kk));
                a[0] = _mm512_fmadd_ps(w0, xv, a[0]);
                a[1] = _mm512_fmadd_ps(w1, xv, a[1]);
                a[2] = _mm512_fmadd_ps(w2, xv, a[2]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: 3 vectors of 16 f32 lanes are exactly COLS floats.
            t.rows
                .store(r, &std::mem::transmute::<[__m512; 3], [f32; COLS]>(*a));
        }
    }

    /// Rows per pass of the quantized kernel: 6 x 3 accumulators beside the
    /// 6 scale/bias vectors and the 3 dequantized weights.
    const ROWS_AFFINE: usize = 6;

    /// # Safety
    /// AVX-512F available; `t` covers `m` rows.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn affine_avx512(t: &AffineTile, m: usize) {
        for r in (0..m).step_by(ROWS_AFFINE) {
            let t = AffineTile {
                rows: t.rows.at_row(r),
                ..*t
            };
            match m - r {
                1 => affine_rows::<1>(&t),
                2 => affine_rows::<2>(&t),
                3 => affine_rows::<3>(&t),
                4 => affine_rows::<4>(&t),
                5 => affine_rows::<5>(&t),
                _ => affine_rows::<ROWS_AFFINE>(&t),
            }
        }
    }

    /// The whole block dequantized into `out` (`k * COLS` floats, k-major).
    ///
    /// # Safety
    /// AVX-512F available; `out.len() == t.rows.k * COLS`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dequantize_avx512(t: &AffineTile, out: &mut [f32]) {
        for g in 0..t.rows.k / t.group {
            for j in 0..3 {
                let s = _mm512_loadu_ps(t.scales.as_ptr().add(g * COLS + 16 * j));
                let b = _mm512_loadu_ps(t.biases.as_ptr().add(g * COLS + 16 * j));
                for kk in g * t.group..(g + 1) * t.group {
                    let at = kk * COLS + 16 * j;
                    let bytes = _mm_loadu_si128(t.q.as_ptr().add(at) as *const __m128i);
                    let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                    _mm512_storeu_ps(out.as_mut_ptr().add(at), _mm512_fmadd_ps(q, s, b));
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn affine_rows<const M: usize>(t: &AffineTile) {
        let mut acc = [[_mm512_setzero_ps(); 3]; M];
        for g in 0..t.rows.k / t.group {
            let (sp, bp) = (
                t.scales.as_ptr().add(g * COLS),
                t.biases.as_ptr().add(g * COLS),
            );
            let mut s = [_mm512_setzero_ps(); 3];
            let mut b = [_mm512_setzero_ps(); 3];
            for j in 0..3 {
                s[j] = _mm512_loadu_ps(sp.add(16 * j));
                b[j] = _mm512_loadu_ps(bp.add(16 * j));
            }
            for kk in g * t.group..(g + 1) * t.group {
                let qp = t.q.as_ptr().add(kk * COLS);
                let mut w = [_mm512_setzero_ps(); 3];
                for j in 0..3 {
                    let bytes = _mm_loadu_si128(qp.add(16 * j) as *const __m128i);
                    let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
                    w[j] = _mm512_fmadd_ps(q, s[j], b[j]);
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_set1_ps(t.rows.x(r, kk));
                    for j in 0..3 {
                        a[j] = _mm512_fmadd_ps(w[j], xv, a[j]);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: 3 vectors of 16 f32 lanes are exactly COLS floats.
            t.rows
                .store(r, &std::mem::transmute::<[__m512; 3], [f32; COLS]>(*a));
        }
    }

    /// # Safety
    /// AVX2 and FMA available; `t` covers `m` rows.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block_avx2(t: &Tile, m: usize) {
        for r in (0..m).step_by(ROWS_256) {
            let t = Tile {
                rows: t.rows.at_row(r),
                ..*t
            };
            if m - r == 1 {
                rows_avx2::<1>(&t);
            } else {
                rows_avx2::<ROWS_256>(&t);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2<const M: usize>(t: &Tile) {
        let mut acc = [[_mm256_setzero_ps(); 6]; M];
        for kk in 0..t.rows.k {
            let wk = t.w.as_ptr().add(kk * COLS);
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_set1_ps(t.rows.x(r, kk));
                for (j, v) in a.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(_mm256_loadu_ps(wk.add(8 * j)), xv, *v);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: 6 vectors of 8 f32 lanes are exactly COLS floats.
            t.rows
                .store(r, &std::mem::transmute::<[__m256; 6], [f32; COLS]>(*a));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Plain f64 reference.
    fn reference(w: &[f32], x: &[f32], n: usize, k: usize, m: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[c * k + i] as f64)
                    .sum();
            }
        }
        y
    }

    fn values(len: usize, seed: u64) -> Vec<f32> {
        // xorshift: deterministic inputs in [-1, 1).
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn check(isa: Isa, n: usize, k: usize, m: usize, seed: u64) -> Result<(), TestCaseError> {
        let w = values(n * k, seed);
        let x = values(m * k, seed + 1);
        let p = PackedWeight::pack(&w, n, k);
        let mut y = vec![f32::NAN; m * n];
        p.matmul_with(isa, &x, m, &mut y);
        let want = reference(&w, &x, n, k, m);
        for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
            // Each term is below 1 in magnitude: k * eps bounds the f32 sum's error.
            let tol = 1e-6 * k as f64 + 1e-6;
            prop_assert!(
                (got as f64 - want).abs() <= tol,
                "{isa:?} n={n} k={k} m={m}: y[{}, {}] = {got}, want {want}",
                i / n,
                i % n
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Every shape, including partial blocks, row counts that are not a
        /// multiple of the kernels' row groups, and k of any length.
        #[test]
        fn packed_matmul_matches_reference(n in 1usize..140, k in 1usize..70, m in 1usize..21, seed in 0u64..1000) {
            for isa in [Isa::detect(), Isa::Avx2, Isa::Portable] {
                check(isa, n, k, m, seed)?;
            }
        }
    }

    /// MLX's affine layout, packed: words hold `32 / bits` values, low bits
    /// first; each group of inputs has its own scale and bias per output.
    fn check_affine(
        isa: Isa,
        n: usize,
        k: usize,
        m: usize,
        group: usize,
        bits: usize,
        seed: u64,
    ) -> Result<(), TestCaseError> {
        let levels = 1u64 << bits;
        let raw = values(n * k, seed);
        let q: Vec<u32> = raw
            .iter()
            .map(|v| (((v + 1.0) / 2.0 * levels as f32) as u64).min(levels - 1) as u32)
            .collect();
        let per_word = 32 / bits;
        let mut words = vec![0u32; n * k / per_word];
        for (i, &v) in q.iter().enumerate() {
            words[i / per_word] |= v << ((i % per_word) * bits);
        }
        let scales: Vec<f32> = values(n * k / group, seed + 2)
            .iter()
            .map(|v| v / levels as f32)
            .collect();
        let biases = values(n * k / group, seed + 3);
        let w: Vec<f32> = (0..n * k)
            .map(|i| {
                let (col, kk) = (i / k, i % k);
                let g = col * (k / group) + kk / group;
                (q[i] as f32).mul_add(scales[g], biases[g])
            })
            .collect();
        let p = PackedWeight::pack_affine(&words, &scales, &biases, n, k, group, bits)
            .map_err(TestCaseError::fail)?;
        let x = values(m * k, seed + 1);
        let mut y = vec![f32::NAN; m * n];
        p.matmul_with(isa, &x, m, &mut y);
        let want = reference(&w, &x, n, k, m);
        for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
            // Weights up to ~2 in magnitude here.
            let tol = 4e-6 * k as f64 + 1e-5;
            prop_assert!(
                (got as f64 - want).abs() <= tol,
                "{isa:?} {bits}-bit n={n} k={k} m={m}: y[{}, {}] = {got}, want {want}",
                i / n,
                i % n
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn packed_affine_matmul_matches_reference(
            n in 1usize..110,
            groups in 1usize..4,
            group in prop::sample::select(vec![32usize, 64]),
            bits in prop::sample::select(vec![2usize, 4, 8]),
            m in 1usize..15,
            seed in 0u64..1000,
        ) {
            for isa in [Isa::detect(), Isa::Portable] {
                check_affine(isa, n, groups * group, m, group, bits, seed)?;
            }
        }
    }

    #[test]
    fn affine_packing_refuses_what_it_cannot_hold() {
        assert!(PackedWeight::pack_affine(&[0; 6], &[0.0; 2], &[0.0; 2], 2, 32, 32, 3).is_err());
        assert!(PackedWeight::pack_affine(&[0; 8], &[0.0; 2], &[0.0; 2], 2, 32, 24, 4).is_err());
        assert!(PackedWeight::pack_affine(&[0; 7], &[0.0; 2], &[0.0; 2], 2, 32, 32, 4).is_err());
    }

    /// Large enough to run on the pool: threads split the blocks.
    #[test]
    fn pooled_matmul_matches_reference() {
        check(Isa::detect(), 1000, 300, 9, 7).unwrap();
        check(Isa::detect(), 49, 576, 33, 8).unwrap();
    }

    /// A row's outputs do not depend on the other rows of the batch.
    #[test]
    fn rows_are_independent_of_the_batch() {
        let (n, k) = (300, 200);
        let p = PackedWeight::pack(&values(n * k, 3), n, k);
        let x = values(11 * k, 4);
        let mut all = vec![0f32; 11 * n];
        p.matmul(&x, 11, &mut all);
        for r in [0, 5, 10] {
            let mut one = vec![0f32; n];
            p.matmul(&x[r * k..][..k], 1, &mut one);
            assert_eq!(one, all[r * n..][..n]);
        }
    }
}
