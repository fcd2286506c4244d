// Few-row products on tensor cores, part 4: the slices' products, then the
// block's sum over its warps and the epilogue (warp 0; the accumulator
// layout: d[t][0, 1] feature n + gq, rows 8t + 2tq (+1); d[t][2, 3] feature
// n + gq + 8).
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                #pragma unroll
                for (int t = 0; t < NT; ++t) {
                    mma(d[t], a[j], bx[t][2 * j], bx[t][2 * j + 1]);
                    if (EPI == 2) {
                        mma(d2[t], a2[j], bx[t][2 * j], bx[t][2 * j + 1]);
                    }
                }
            }
        }
        #pragma unroll
        for (int t = 0; t < NT; ++t) {
            part[0][t][warp][lane] = make_float4(d[t][0], d[t][1], d[t][2], d[t][3]);
            if (EPI == 2) {
                part[EPI == 2 ? 1 : 0][t][warp][lane] =
                    make_float4(d2[t][0], d2[t][1], d2[t][2], d2[t][3]);
            }
        }
        __syncthreads();
        if (warp == 0) {
            #pragma unroll
            for (int t = 0; t < NT; ++t) {
                float s[4] = {0.f, 0.f, 0.f, 0.f};
                float s2[4] = {0.f, 0.f, 0.f, 0.f};
                #pragma unroll
                for (int m = 0; m < MW; ++m) {
                    const float4 p = part[0][t][m][lane];
                    s[0] += p.x;
                    s[1] += p.y;
                    s[2] += p.z;
                    s[3] += p.w;
                    if (EPI == 2) {
                        const float4 p2 = part[EPI == 2 ? 1 : 0][t][m][lane];
                        s2[0] += p2.x;
                        s2[1] += p2.y;
                        s2[2] += p2.z;
                        s2[3] += p2.w;
                    }
                }
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int row = 8 * t + 2 * tq + (i & 1);
                    const int col = n + gq + 8 * (i >> 1);
                    if (row < NR) {
                        emit((size_t)row * NO + col, s[i], s2[i]);
                    }
                }
            }
        }
        __syncthreads();
    }
