// Few-row GEMV, part 3: the reductions and the epilogue (closes the column
// loop of gemv_head.cu).
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            float v = acc[b];
            float v2 = acc2[b];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                v += __shfl_xor_sync(0xffffffffu, v, o);
                if (EPI == 2) {
                    v2 += __shfl_xor_sync(0xffffffffu, v2, o);
                }
            }
            if (lane == 0) {
                const size_t o = (size_t)b * NO + n;
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
            }
        }
    }
