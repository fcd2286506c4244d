// y[b, n] = sum_k x[b, k] * w[n, k] for a few rows (NB, a template
// argument): one warp per output column n, 16-byte loads of the weight row,
// f32 accumulation, a warp shuffle reduction. x [NB, K], w [N, K], y [NB, N],
// all of dtype DT; K must be a multiple of 16 / sizeof(DT).
    constexpr int VEC = 16 / sizeof(DT);
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int n = (int)(((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (n >= N) {
        return;
    }
    const int KV = K / VEC;
    const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)n * KV;
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    float acc[NB];
    #pragma unroll
    for (int b = 0; b < NB; ++b) {
        acc[b] = 0.f;
    }
    #pragma unroll 4
    for (int c = lane; c < KV; c += 32) {
        const uint4 wv = wr[c];
        const DT* wp = reinterpret_cast<const DT*>(&wv);
        float wf[VEC];
        #pragma unroll
        for (int j = 0; j < VEC; ++j) {
            wf[j] = static_cast<float>(wp[j]);
        }
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            const uint4 xv = xr[(size_t)b * KV + c];
            const DT* xp = reinterpret_cast<const DT*>(&xv);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) {
                acc[b] += wf[j] * static_cast<float>(xp[j]);
            }
        }
    }
    #pragma unroll
    for (int b = 0; b < NB; ++b) {
        float v = acc[b];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, o);
        }
        if (lane == 0) {
            y[(size_t)b * N + n] = static_cast<DT>(v);
        }
    }
