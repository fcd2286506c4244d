// Few-row GEMV, part 3 (dense weights w [N, K] of dtype DT; K a multiple of
// 16 / sizeof(DT)). Columns n .. n + NC - 1 (and their up halves n + NO ..
// with EPI 2); each input vector is loaded once for all of them.
        const int KV = KVEC;
        const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)n * KV;
        const uint4* wr2 = reinterpret_cast<const uint4*>(w) + (size_t)(n + NO) * KV;
        const uint4* xr = reinterpret_cast<const uint4*>(xin);
        const uint4* nr = reinterpret_cast<const uint4*>(nw);
        #pragma unroll (NC == 1 ? 4 : 1)
        for (int c = lane; c < KV; c += 32) {
            uint4 wv[NC];
            uint4 wv2[NC];
            #pragma unroll
            for (int j = 0; j < NC; ++j) {
                wv[j] = wr[(size_t)j * KV + c];
                wv2[j] = EPI == 2 ? wr2[(size_t)j * KV + c] : make_uint4(0u, 0u, 0u, 0u);
            }
            const uint4 nv = renorm ? nr[c] : make_uint4(0u, 0u, 0u, 0u);
            const DT* np = reinterpret_cast<const DT*>(&nv);
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                const uint4 xv = xr[(size_t)b * KV + c];
                const DT* xp = reinterpret_cast<const DT*>(&xv);
                #pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    float xf = static_cast<float>(xp[e]);
                    if (renorm) {
                        xf = static_cast<float>(normed(xf, np[e], b));
                    }
                    #pragma unroll
                    for (int j = 0; j < NC; ++j) {
                        acc[j][b] += static_cast<float>(reinterpret_cast<const DT*>(&wv[j])[e]) * xf;
                        if (EPI == 2) {
                            acc2[j][b] += static_cast<float>(reinterpret_cast<const DT*>(&wv2[j])[e]) * xf;
                        }
                    }
                }
            }
        }
