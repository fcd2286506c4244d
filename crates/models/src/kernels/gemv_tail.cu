// Few-row GEMV, part 4: the reductions and the epilogue of each of the
// warp's NC columns (closes the column loop of gemv_cols.cu).
        #pragma unroll
        for (int j = 0; j < NC; ++j) {
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                float v = acc[j][b];
                float v2 = acc2[j][b];
                #pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (EPI == 2) {
                        v2 += __shfl_xor_sync(0xffffffffu, v2, o);
                    }
                }
                if (lane == 0) {
                    emit((size_t)b * NO + n + j, v, v2);
                }
            }
        }
    }
