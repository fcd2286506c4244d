// Few-row products on tensor cores, part 2 (after gemv_head.cu): for 2-16
// rows, y^T = W x^T with mma.sync m16n8k16 (DT in, f32 accumulation). A warp
// tile is 16 output features (the M side, weights) by the rows padded to
// NT * 8 (the N side); the block's MW warps split K between them and sum
// their tiles through shared memory. Within a step of 128 k, the lane
// (gq, tq) holds k0 .. k0 + 31 (k0 = 128 kb + 32 tq) of weight rows n + gq
// and n + gq + 8 and of input row gq (+ 8): eight k-slices of the sum,
// whose k order is permuted the same way in A and B (slice j's slots
// 2tq, 2tq + 1, 2tq + 8, 2tq + 9 are k0 + 4j .. k0 + 4j + 3), so each
// 32-bit word of a 16-byte load is one fragment register as it is.
// K must be a multiple of 128, NO of 16; blockDim.x = 32 * MW.
    constexpr int NT = (NB + 7) / 8;
    constexpr int MW = 4;
    const int gq = lane >> 2;
    const int tq = lane & 3;
    const int KB = K / 128;
    __shared__ float4 part[EPI == 2 ? 2 : 1][NT][MW][32];
    auto mma = [](float* d, const unsigned int* a, unsigned int b0, unsigned int b1) {
        if (BF16) {
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        } else {
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        }
    };
    for (int tile = blockIdx.x; tile * 16 < NO; tile += gridDim.x) {
        const int n = tile * 16;
        float d[NT][4];
        float d2[NT][4];
        #pragma unroll
        for (int t = 0; t < NT; ++t) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                d[t][i] = 0.f;
                d2[t][i] = 0.f;
            }
        }
        for (int kb = warp; kb < KB; kb += MW) {
            const int k0 = kb * 128 + tq * 32;
            // B: input row gq + 8 t, k0 .. k0 + 31 (zeros past NR).
            unsigned int bx[NT][16];
            #pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int row = gq + 8 * t;
                #pragma unroll
                for (int q = 0; q < 4; ++q) {
                    uint4 v = make_uint4(0u, 0u, 0u, 0u);
                    if (row < NR) {
                        v = reinterpret_cast<const uint4*>(xin + (size_t)row * K + k0)[q];
                        if (renorm) {
                            const uint4 nv = reinterpret_cast<const uint4*>(nw + k0)[q];
                            const DT* xp = reinterpret_cast<const DT*>(&v);
                            const DT* np = reinterpret_cast<const DT*>(&nv);
                            DT o[8];
                            #pragma unroll
                            for (int e = 0; e < 8; ++e) {
                                o[e] = normed(static_cast<float>(xp[e]), np[e], row);
                            }
                            v = *reinterpret_cast<const uint4*>(o);
                        }
                    }
                    bx[t][4 * q] = v.x;
                    bx[t][4 * q + 1] = v.y;
                    bx[t][4 * q + 2] = v.z;
                    bx[t][4 * q + 3] = v.w;
                }
            }
            // A: slice j's registers for features n + gq (0, 2) and n + gq + 8
            // (1, 3); a2 the same of the up rows n + NO + ... with EPI 2.
            unsigned int a[8][4];
            unsigned int a2[8][4];
