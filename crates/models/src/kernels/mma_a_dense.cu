// Few-row products on tensor cores, part 3 (dense weights w [N, K] of DT):
// the fragments are the weight words as loaded.
            {
                auto rows = [&](int r, unsigned int (*dst)[4]) {
                    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)r * K + k0);
                    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)(r + 8) * K + k0);
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const uint4 u0 = w0[q];
                        const uint4 u1 = w1[q];
                        dst[2 * q][0] = u0.x;
                        dst[2 * q][1] = u1.x;
                        dst[2 * q][2] = u0.y;
                        dst[2 * q][3] = u1.y;
                        dst[2 * q + 1][0] = u0.z;
                        dst[2 * q + 1][1] = u1.z;
                        dst[2 * q + 1][2] = u0.w;
                        dst[2 * q + 1][3] = u1.w;
                    }
                };
                rows(n + gq, a);
                if (EPI == 2) {
                    rows(n + NO + gq, a2);
                }
            }
