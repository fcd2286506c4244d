// Few-row GEMV, part 3 (MLX affine 4-bit weights: w uint32 [N, K / 8], eight
// nibbles per word, lowest first; scales, biases [N, K / G] of dtype DT, G a
// multiple of 32). Each lane reads 16 bytes (32 weights of one group) of
// each of its NC columns (and their up halves with EPI 2). One row folds the
// affine map out of the inner loop (s * sum(x * q) + b * sum(x)); several
// rows dequantize each weight once (s * q + b) for all of them, and load
// each input vector once for all the columns.
        const int KC = K / 32;
        const int groups = K / G;
        const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)n * KC;
        const uint4* wr2 = reinterpret_cast<const uint4*>(w) + (size_t)(n + NO) * KC;
        const DT* sr = scales + (size_t)n * groups;
        const DT* br = biases + (size_t)n * groups;
        const DT* sr2 = scales + (size_t)(n + NO) * groups;
        const DT* br2 = biases + (size_t)(n + NO) * groups;
        #pragma unroll (NC == 1 ? 2 : 1)
        for (int c = lane; c < KC; c += 32) {
            const int g = (c * 32) / G;
            uint4 wv[NC];
            uint4 wv2[NC];
            float s[NC];
            float bias[NC];
            float s2[NC];
            float bias2[NC];
            #pragma unroll
            for (int j = 0; j < NC; ++j) {
                wv[j] = wr[(size_t)j * KC + c];
                s[j] = static_cast<float>(sr[(size_t)j * groups + g]);
                bias[j] = static_cast<float>(br[(size_t)j * groups + g]);
                if (EPI == 2) {
                    wv2[j] = wr2[(size_t)j * KC + c];
                    s2[j] = static_cast<float>(sr2[(size_t)j * groups + g]);
                    bias2[j] = static_cast<float>(br2[(size_t)j * groups + g]);
                } else {
                    wv2[j] = make_uint4(0u, 0u, 0u, 0u);
                    s2[j] = 0.f;
                    bias2[j] = 0.f;
                }
            }
            if (NB == 1) {
                #pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const uint4* xq = reinterpret_cast<const uint4*>(xin + (size_t)b * K + (size_t)c * 32);
                    const uint4* nq = reinterpret_cast<const uint4*>(nw + (size_t)c * 32);
                    float dot[NC];
                    float dot2[NC];
                    #pragma unroll
                    for (int j = 0; j < NC; ++j) {
                        dot[j] = 0.f;
                        dot2[j] = 0.f;
                    }
                    float sx = 0.f;
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const uint4 xv = xq[q];
                        const uint4 nv = renorm ? nq[q] : make_uint4(0u, 0u, 0u, 0u);
                        const DT* xp = reinterpret_cast<const DT*>(&xv);
                        const DT* np = reinterpret_cast<const DT*>(&nv);
                        #pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            float xf = static_cast<float>(xp[e]);
                            if (renorm) {
                                xf = static_cast<float>(normed(xf, np[e], b));
                            }
                            #pragma unroll
                            for (int j = 0; j < NC; ++j) {
                                const unsigned int wq = reinterpret_cast<const unsigned int*>(&wv[j])[q];
                                dot[j] += xf * static_cast<float>((wq >> (4 * e)) & 15u);
                                if (EPI == 2) {
                                    const unsigned int wq2 = reinterpret_cast<const unsigned int*>(&wv2[j])[q];
                                    dot2[j] += xf * static_cast<float>((wq2 >> (4 * e)) & 15u);
                                }
                            }
                            sx += xf;
                        }
                    }
                    #pragma unroll
                    for (int j = 0; j < NC; ++j) {
                        acc[j][b] += s[j] * dot[j] + bias[j] * sx;
                        if (EPI == 2) {
                            acc2[j][b] += s2[j] * dot2[j] + bias2[j] * sx;
                        }
                    }
                }
            } else {
                #pragma unroll
                for (int q = 0; q < 4; ++q) {
                    uint4 xv[NB];
                    #pragma unroll
                    for (int b = 0; b < NB; ++b) {
                        xv[b] = reinterpret_cast<const uint4*>(xin + (size_t)b * K + (size_t)c * 32)[q];
                    }
                    const uint4 nv = renorm
                        ? reinterpret_cast<const uint4*>(nw + (size_t)c * 32)[q]
                        : make_uint4(0u, 0u, 0u, 0u);
                    const DT* np = reinterpret_cast<const DT*>(&nv);
                    #pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        float wf[NC];
                        float wf2[NC];
                        #pragma unroll
                        for (int j = 0; j < NC; ++j) {
                            const unsigned int wq = reinterpret_cast<const unsigned int*>(&wv[j])[q];
                            wf[j] = fmaf(s[j], static_cast<float>((wq >> (4 * e)) & 15u), bias[j]);
                            if (EPI == 2) {
                                const unsigned int wq2 = reinterpret_cast<const unsigned int*>(&wv2[j])[q];
                                wf2[j] = fmaf(s2[j], static_cast<float>((wq2 >> (4 * e)) & 15u), bias2[j]);
                            }
                        }
                        #pragma unroll
                        for (int b = 0; b < NB; ++b) {
                            float xf = static_cast<float>(reinterpret_cast<const DT*>(&xv[b])[e]);
                            if (renorm) {
                                xf = static_cast<float>(normed(xf, np[e], b));
                            }
                            #pragma unroll
                            for (int j = 0; j < NC; ++j) {
                                acc[j][b] = fmaf(wf[j], xf, acc[j][b]);
                                if (EPI == 2) {
                                    acc2[j][b] = fmaf(wf2[j], xf, acc2[j][b]);
                                }
                            }
                        }
                    }
                }
            }
        }
