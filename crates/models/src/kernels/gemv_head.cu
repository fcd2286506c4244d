// Few-row GEMV kernels, part 1 of 3 (head, then gemv_dense.cu or gemv_q4.cu,
// then gemv_tail.cu; crates/models/src/gemv.rs joins them):
//   y[b, n] = EPI(sum_k NORM(x)[b, k] * w[n, k])      for b < NB rows
// NORM = 1: x's rows are RMS-normalized first, rounded where MLX's
//   rms_norm rounds (x * rsqrt(mean(x^2) + eps) to DT, then * nw to DT);
//   every block computes the rows' inverse RMS itself (no extra launch) and
//   stages the normalized rows in shared memory.
// EPI = 0: y = DT(acc); 1: y = DT(res + DT(acc)) (the residual add);
//   2: w holds [gate; up] (2F rows), y[b, j] = silu(gate_j) * up_j, [NB, F].
// One warp per output column (grid-stride), 16-byte weight loads, f32
// accumulation, warp-shuffle reductions. Inputs nw, eps and res are read
// only when NORM / EPI use them.
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int WPB = blockDim.x >> 5;
    const int N = w_shape[0];
    const int K = x_shape[1];
    const int NO = EPI == 2 ? N / 2 : N;
    __shared__ float inv_s[NB];
    if (NORM) {
        __shared__ float red[NB][32];
        float ss[NB];
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            ss[b] = 0.f;
        }
        for (int k = threadIdx.x; k < K; k += blockDim.x) {
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float f = static_cast<float>(x[(size_t)b * K + k]);
                ss[b] += f * f;
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
    // With NORM, the normalized rows are staged once per block in shared
    // memory when they fit (16 KB), else normalized again at every use.
    __shared__ uint4 xs4[NORM ? 1024 : 1];
    const bool staged = NORM && (size_t)NB * K * sizeof(DT) <= sizeof(xs4);
    if (staged) {
        DT* xs = reinterpret_cast<DT*>(xs4);
        for (int i = threadIdx.x; i < NB * K; i += blockDim.x) {
            const DT r = static_cast<DT>(static_cast<float>(x[i]) * inv_s[i / K]);
            xs[i] = static_cast<DT>(static_cast<float>(nw[i % K]) * static_cast<float>(r));
        }
        __syncthreads();
    }
    const DT* xin = staged ? reinterpret_cast<const DT*>(xs4) : x;
    const bool renorm = NORM && !staged;
    for (int n = blockIdx.x * WPB + warp; n < NO; n += gridDim.x * WPB) {
        float acc[NB];
        float acc2[NB];
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            acc[b] = 0.f;
            acc2[b] = 0.f;
        }
