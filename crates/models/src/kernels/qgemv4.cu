// y[b, n] = sum_k x[b, k] * (scales[n, k / G] * q[n, k] + biases[n, k / G])
// for a few rows (NB): MLX's affine 4-bit layout (w uint32 [N, K / 8], eight
// nibbles per word, lowest first; scales and biases [N, K / G] of dtype DT).
// One warp per output column n; each lane reads 16 bytes (32 weights, within
// one group since G >= 32) and folds the affine map out of the inner loop:
// s * sum(x * q) + b * sum(x). x [NB, K] and y [NB, N] of dtype DT (2 bytes).
    const int N = w_shape[0];
    const int KW = w_shape[1];
    const int K = KW * 8;
    const int n = (int)(((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (n >= N) {
        return;
    }
    const int KC = KW / 4;
    const int groups = K / G;
    const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)n * KC;
    const DT* sr = scales + (size_t)n * groups;
    const DT* br = biases + (size_t)n * groups;
    float acc[NB];
    #pragma unroll
    for (int b = 0; b < NB; ++b) {
        acc[b] = 0.f;
    }
    #pragma unroll 2
    for (int c = lane; c < KC; c += 32) {
        const uint4 wv = wr[c];
        const unsigned int words[4] = {wv.x, wv.y, wv.z, wv.w};
        const int g = (c * 32) / G;
        const float s = static_cast<float>(sr[g]);
        const float bias = static_cast<float>(br[g]);
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            const uint4* xq = reinterpret_cast<const uint4*>(x + (size_t)b * K + (size_t)c * 32);
            float dot = 0.f;
            float sx = 0.f;
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint4 xv = xq[q];
                const DT* xp = reinterpret_cast<const DT*>(&xv);
                const unsigned int wq = words[q];
                #pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float xf = static_cast<float>(xp[j]);
                    dot += xf * static_cast<float>((wq >> (4 * j)) & 15u);
                    sx += xf;
                }
            }
            acc[b] += s * dot + bias * sx;
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
