// Few-row GEMV, part 2: each warp takes NC adjacent output columns
// (grid-stride; NO a multiple of NC), one f32 sum per column and row.
    for (int n = (blockIdx.x * WPB + warp) * NC; n < NO; n += gridDim.x * WPB * NC) {
        float acc[NC][NB];
        float acc2[NC][NB];
        #pragma unroll
        for (int j = 0; j < NC; ++j) {
            #pragma unroll
            for (int b = 0; b < NB; ++b) {
                acc[j][b] = 0.f;
                acc2[j][b] = 0.f;
            }
        }
