// Few-row products on tensor cores, part 3 (MLX affine 4-bit weights, as in
// gemv_q4.cu; G a multiple of 32): a lane's 32 k of a row are one 16-byte
// load and one group, dequantized (s * q + b, rounded to DT) into the
// fragments.
            {
                // Two DT values as one fragment register (lo at the lower k).
                auto pack = [](float lo, float hi) -> unsigned int {
                    const DT l = static_cast<DT>(lo);
                    const DT h = static_cast<DT>(hi);
                    return static_cast<unsigned int>(*reinterpret_cast<const unsigned short*>(&l))
                        | (static_cast<unsigned int>(*reinterpret_cast<const unsigned short*>(&h)) << 16);
                };
                const int groups = K / G;
                const int gi = k0 / G;
                auto rows = [&](int r, unsigned int (*dst)[4]) {
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const size_t row = (size_t)(r + 8 * h);
                        const uint4 u = reinterpret_cast<const uint4*>(w)[(row * K + k0) / 32];
                        const float s = static_cast<float>(scales[row * groups + gi]);
                        const float bi = static_cast<float>(biases[row * groups + gi]);
                        const unsigned int words[4] = {u.x, u.y, u.z, u.w};
                        #pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            const unsigned int wq = words[j / 2] >> (16 * (j % 2));
                            const float q0 = static_cast<float>(wq & 15u);
                            const float q1 = static_cast<float>((wq >> 4) & 15u);
                            const float q2 = static_cast<float>((wq >> 8) & 15u);
                            const float q3 = static_cast<float>((wq >> 12) & 15u);
                            dst[j][h] = pack(fmaf(s, q0, bi), fmaf(s, q1, bi));
                            dst[j][2 + h] = pack(fmaf(s, q2, bi), fmaf(s, q3, bi));
                        }
                    }
                };
                rows(n + gq, a);
                if (EPI == 2) {
                    rows(n + NO + gq, a2);
                }
            }
