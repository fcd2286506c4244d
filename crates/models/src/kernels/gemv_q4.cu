// Few-row GEMV, part 2 (MLX affine 4-bit weights: w uint32 [N, K / 8], eight
// nibbles per word, lowest first; scales, biases [N, K / G] of dtype DT, G a
// multiple of 32). Each lane reads 16 bytes (32 weights of one group) and
// folds the affine map out of the inner loop: s * sum(x * q) + b * sum(x).
        const int KC = K / 32;
        const int groups = K / G;
        const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)n * KC;
        const uint4* wr2 = reinterpret_cast<const uint4*>(w) + (size_t)(n + NO) * KC;
        const DT* sr = scales + (size_t)n * groups;
        const DT* br = biases + (size_t)n * groups;
        const DT* sr2 = scales + (size_t)(n + NO) * groups;
        const DT* br2 = biases + (size_t)(n + NO) * groups;
        #pragma unroll 2
        for (int c = lane; c < KC; c += 32) {
            const uint4 wv = wr[c];
            const uint4 wv2 = EPI == 2 ? wr2[c] : make_uint4(0u, 0u, 0u, 0u);
            const unsigned int words[4] = {wv.x, wv.y, wv.z, wv.w};
            const unsigned int words2[4] = {wv2.x, wv2.y, wv2.z, wv2.w};
            const int g = (c * 32) / G;
            const float s = static_cast<float>(sr[g]);
            const float bias = static_cast<float>(br[g]);
            const float s2 = EPI == 2 ? static_cast<float>(sr2[g]) : 0.f;
            const float bias2 = EPI == 2 ? static_cast<float>(br2[g]) : 0.f;
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                const uint4* xq = reinterpret_cast<const uint4*>(xin + (size_t)b * K + (size_t)c * 32);
                const uint4* nq = reinterpret_cast<const uint4*>(nw + (size_t)c * 32);
                float dot = 0.f;
                float dot2 = 0.f;
                float sx = 0.f;
                #pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const uint4 xv = xq[q];
                    const uint4 nv = renorm ? nq[q] : make_uint4(0u, 0u, 0u, 0u);
                    const DT* xp = reinterpret_cast<const DT*>(&xv);
                    const DT* np = reinterpret_cast<const DT*>(&nv);
                    const unsigned int wq = words[q];
                    const unsigned int wq2 = words2[q];
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        float xf = static_cast<float>(xp[j]);
                        if (renorm) {
                            const DT r = static_cast<DT>(xf * inv_s[b]);
                            xf = static_cast<float>(static_cast<DT>(
                                static_cast<float>(np[j]) * static_cast<float>(r)));
                        }
                        dot += xf * static_cast<float>((wq >> (4 * j)) & 15u);
                        if (EPI == 2) {
                            dot2 += xf * static_cast<float>((wq2 >> (4 * j)) & 15u);
                        }
                        sx += xf;
                    }
                }
                acc[b] += s * dot + bias * sx;
                if (EPI == 2) {
                    acc2[b] += s2 * dot2 + bias2 * sx;
                }
            }
        }
