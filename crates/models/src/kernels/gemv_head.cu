// Few-row products, part 1: the prologue shared by the GEMV kernels (then
// gemv_cols.cu, gemv_dense.cu or gemv_q4.cu, gemv_tail.cu) and the
// tensor-core ones (then mma_open.cu, mma_a_dense.cu or mma_a_q4.cu,
// mma_close.cu); crates/models/src/gemv.rs joins them after a line that sets
// XS_CAP, the 16-byte words of shared memory that may stage the input:
//   y[b, n] = EPI(sum_k NORM(x)[b, k] * w[n, k])      for b < NR rows
// NR = NB, or with ROWS_RT = 1 (the tensor-core kernels) x's row count, NB
//   being the capacity the kernel is built for (8 or 16): one build serves
//   every row count up to it (each build costs seconds of a start in MLX).
// NORM = 1: x's rows are RMS-normalized first, rounded where MLX's
//   rms_norm rounds (x * rsqrt(mean(x^2) + eps) to DT, then * nw to DT);
//   every block computes the rows' inverse RMS itself (no extra launch) and
//   stages the normalized rows in shared memory.
// EPI = 0: y = DT(acc); 1: y = DT(res + DT(acc)) (the residual add);
//   2: w holds [gate; up] (2F rows), y[b, j] = silu(gate_j) * up_j, [NB, F]
//   (`emit` below).
// Each warp computes NC adjacent output columns (grid-stride; NO a multiple
// of NC): every input vector it loads serves all NC columns, which is what
// makes several rows pay (with one column per warp, each row's input is read
// again for every column). 16-byte weight loads, f32 accumulation,
// warp-shuffle reductions. Inputs nw, eps and res are read only when NORM /
// EPI use them.
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int WPB = blockDim.x >> 5;
    const int N = w_shape[0];
    const int K = x_shape[1];
    const int NR = ROWS_RT ? x_shape[0] : NB;
    const int NO = EPI == 2 ? N / 2 : N;
    // Elements per 16-byte word; K is a multiple of it.
    constexpr int VEC = 16 / sizeof(DT);
    const int KVEC = K / VEC;
    __shared__ float inv_s[NB];
    // 16-byte word c of every input row, all loads issued at once (zeros
    // past NR).
    auto load_rows = [&](int c, uint4* v) {
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            v[b] = b < NR ? reinterpret_cast<const uint4*>(x + (size_t)b * K)[c]
                          : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    if (NORM) {
        __shared__ float red[NB][32];
        float ss[NB];
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            ss[b] = 0.f;
        }
        // 16-byte loads, every row's at once: a block's prologue is on the
        // critical path of every launch (one round of loads for K up to
        // blockDim.x 16-byte words).
        for (int c = threadIdx.x; c < KVEC; c += blockDim.x) {
            uint4 v[NB];
            load_rows(c, v);
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                const DT* p = reinterpret_cast<const DT*>(&v[b]);
                #pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float f = static_cast<float>(p[e]);
                    ss[b] += f * f;
                }
            }
        }
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            float v = ss[b];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                v += __shfl_xor_sync(0xffffffffu, v, o);
            }
            if (lane == 0) {
                red[b][warp] = v;
            }
        }
        __syncthreads();
        if (warp == 0) {
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                float v = lane < WPB ? red[b][lane] : 0.f;
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    v += __shfl_xor_sync(0xffffffffu, v, o);
                }
                if (lane == 0) {
                    inv_s[b] = rsqrtf(v / K + static_cast<float>(eps[0]));
                }
            }
        }
        __syncthreads();
    }
    // Element k of row b normalized as MLX's rms_norm rounds it (xe =
    // x[b, k], we = nw[k]): DT(xe * inv_s[b]), then DT(we * that).
    auto normed = [&](float xe, DT we, int b) -> DT {
        const DT r = static_cast<DT>(xe * inv_s[b]);
        return static_cast<DT>(static_cast<float>(we) * static_cast<float>(r));
    };
    // With NORM, the normalized rows are staged once per block in shared
    // memory when they fit (XS_CAP words), else normalized again at every use.
    __shared__ uint4 xs4[NORM ? XS_CAP : 1];
    const bool staged = NORM && (size_t)NB * K * sizeof(DT) <= sizeof(xs4);
    if (staged) {
        for (int c = threadIdx.x; c < KVEC; c += blockDim.x) {
            const uint4 nv = reinterpret_cast<const uint4*>(nw)[c];
            const DT* np = reinterpret_cast<const DT*>(&nv);
            uint4 v[NB];
            load_rows(c, v);
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                DT o[VEC];
                const DT* p = reinterpret_cast<const DT*>(&v[b]);
                #pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    o[e] = normed(static_cast<float>(p[e]), np[e], b);
                }
                xs4[(size_t)b * KVEC + c] = *reinterpret_cast<const uint4*>(o);
            }
        }
        __syncthreads();
    }
    const DT* xin = staged ? reinterpret_cast<const DT*>(xs4) : x;
    const bool renorm = NORM && !staged;
    // The epilogue of output o (row-major [NB, NO]) from the f32 sums of its
    // column (v) and, with EPI 2, of its up column (v2).
    auto emit = [&](size_t o, float v, float v2) {
        if (EPI == 0) {
            y[o] = static_cast<DT>(v);
        } else if (EPI == 1) {
            y[o] = static_cast<DT>(
                static_cast<float>(res[o]) + static_cast<float>(static_cast<DT>(v)));
        } else {
            const float g = static_cast<float>(static_cast<DT>(v));
            const float u = static_cast<float>(static_cast<DT>(v2));
            const DT sig = static_cast<DT>(1.f / (1.f + expf(-g)));
            const DT gs = static_cast<DT>(g * static_cast<float>(sig));
            y[o] = static_cast<DT>(static_cast<float>(gs) * u);
        }
    };
