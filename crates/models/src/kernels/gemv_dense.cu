// Few-row GEMV, part 2 (dense weights w [N, K] of dtype DT; K a multiple of
// 16 / sizeof(DT)).
        constexpr int VEC = 16 / sizeof(DT);
        const int KV = K / VEC;
        const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)n * KV;
        const uint4* wr2 = reinterpret_cast<const uint4*>(w) + (size_t)(n + NO) * KV;
        const uint4* xr = reinterpret_cast<const uint4*>(xin);
        const uint4* nr = reinterpret_cast<const uint4*>(nw);
        #pragma unroll 4
        for (int c = lane; c < KV; c += 32) {
            const uint4 wv = wr[c];
            const uint4 wv2 = EPI == 2 ? wr2[c] : make_uint4(0u, 0u, 0u, 0u);
            const uint4 nv = renorm ? nr[c] : make_uint4(0u, 0u, 0u, 0u);
            const DT* wp = reinterpret_cast<const DT*>(&wv);
            const DT* wp2 = reinterpret_cast<const DT*>(&wv2);
            const DT* np = reinterpret_cast<const DT*>(&nv);
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                const uint4 xv = xr[(size_t)b * KV + c];
                const DT* xp = reinterpret_cast<const DT*>(&xv);
                #pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    float xf = static_cast<float>(xp[j]);
                    if (renorm) {
                        const DT r = static_cast<DT>(xf * inv_s[b]);
                        xf = static_cast<float>(static_cast<DT>(
                            static_cast<float>(np[j]) * static_cast<float>(r)));
                    }
                    acc[b] += static_cast<float>(wp[j]) * xf;
                    if (EPI == 2) {
                        acc2[b] += static_cast<float>(wp2[j]) * xf;
                    }
                }
            }
        }
