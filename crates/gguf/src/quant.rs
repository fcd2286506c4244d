//! Lossless mapping of ggml block formats onto MLX's affine quantization,
//! reference dequantizers for both sides, and the q/k row un-permutation.
//!
//! ggml's `Q4_0`, `Q4_1` and `Q8_0` all store, per block of 32 consecutive
//! elements of a row, one f16 scale `d` (and for `Q4_1` one f16 offset `m`)
//! plus unsigned or signed integers. MLX's affine mode stores, per group of
//! `group_size` consecutive elements of a row, `scale` and `bias` with
//! `value = scale * q + bias` for an unsigned `q` of `bits` bits. So:
//!
//! | ggml   | value            | MLX bits | scale | bias     | q      |
//! |--------|------------------|----------|-------|----------|--------|
//! | Q4_1   | `d * q + m`      | 4        | `d`   | `m`      | `q`    |
//! | Q4_0   | `d * (q - 8)`    | 4        | `d`   | `-8 d`   | `q`    |
//! | Q8_0   | `d * q` (signed) | 8        | `d`   | `-128 d` | `q+128`|
//!
//! `-8 d` and `-128 d` are exact in f16 (a power-of-two multiple) unless they
//! overflow, which is checked. Only the order of the packed integers differs:
//! in a ggml 4-bit block byte `j` holds element `j` in its low nibble and
//! element `j + 16` in its high nibble; MLX packs 8 consecutive 4-bit values
//! (or 4 consecutive 8-bit values) per little-endian `u32`, first element in
//! the lowest bits.

use half::{bf16, f16};

use crate::error::GgufError;
use crate::reader::GgmlType;

type Result<T> = std::result::Result<T, GgufError>;

/// Elements per ggml block (and per MLX group in the converted model).
pub const GROUP_SIZE: usize = 32;

/// A matrix in MLX's affine-quantized layout.
#[derive(Debug, Clone, PartialEq)]
pub struct MlxQuantized {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Bits per element (4 or 8).
    pub bits: u32,
    /// Elements per scale/bias group.
    pub group_size: usize,
    /// Packed values, `[rows, cols * bits / 32]`.
    pub weight: Vec<u32>,
    /// Per-group scales, `[rows, cols / group_size]`.
    pub scales: Vec<f16>,
    /// Per-group biases, `[rows, cols / group_size]`.
    pub biases: Vec<f16>,
}

impl MlxQuantized {
    /// Dequantizes in f32, the way MLX defines it: `scale * q + bias`.
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_mlx(
            &self.weight,
            &self.scales,
            &self.biases,
            self.bits,
            self.group_size,
            self.rows,
            self.cols,
        )
    }
}

/// MLX bits for the ggml types that map onto MLX affine quantization.
pub fn mlx_bits(ty: GgmlType) -> Option<u32> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => Some(4),
        GgmlType::Q8_0 => Some(8),
        _ => None,
    }
}

/// `ty` has no lossless MLX affine form.
fn unsupported_mlx(name: &str, ty: GgmlType) -> GgufError {
    GgufError::UnsupportedTensorType {
        name: name.to_string(),
        type_name: ty.name(),
        supported: "F32, F16, BF16, Q4_0, Q4_1, Q8_0 (lossless MLX affine)",
    }
}

/// `ty` cannot be dequantized here.
fn unsupported(name: &str, ty: GgmlType) -> GgufError {
    GgufError::UnsupportedTensorType {
        name: name.to_string(),
        type_name: ty.name(),
        supported: DEQUANTIZABLE,
    }
}

fn f16_at(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

/// `k * d` as f16, provided it is exactly representable (it is unless it overflows).
fn exact_multiple(name: &str, d: f16, k: f32) -> Result<f16> {
    let want = d.to_f32() * k;
    let got = f16::from_f32(want);
    if got.to_f32() == want {
        Ok(got)
    } else {
        Err(GgufError::bad_tensor(
            name,
            format!("block scale {d} cannot be rewritten losslessly as an f16 MLX bias ({want})"),
        ))
    }
}

fn check_shape(name: &str, ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Result<usize> {
    let (block_elems, block_bytes) = ty.block_layout().ok_or_else(|| unsupported(name, ty))?;
    let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
    if cols % block_elems != 0 {
        return Err(GgufError::bad_tensor(
            name,
            format!("row length {cols} is not a multiple of the {ty} block size {block_elems}"),
        ));
    }
    let n_blocks = rows
        .checked_mul(cols / block_elems)
        .ok_or_else(|| GgufError::bad_tensor(name, "size overflows"))?;
    if n_blocks.checked_mul(block_bytes) != Some(data.len()) {
        return Err(GgufError::bad_tensor(
            name,
            format!(
                "{} bytes of data for a {rows}x{cols} {ty} matrix (expected {} blocks of {block_bytes} bytes)",
                data.len(),
                n_blocks
            ),
        ));
    }
    Ok(n_blocks)
}

/// Re-lays a `[rows, cols]` ggml-quantized matrix (`Q4_0`, `Q4_1` or `Q8_0`)
/// in MLX's affine layout, without changing any value.
pub fn gguf_to_mlx(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
) -> Result<MlxQuantized> {
    let bits = mlx_bits(ty).ok_or_else(|| unsupported_mlx(name, ty))?;
    let n_blocks = check_shape(name, ty, data, rows, cols)?;
    let block_bytes = data.len() / n_blocks.max(1);
    let words_per_block = GROUP_SIZE * bits as usize / 32;
    let mut weight = Vec::with_capacity(n_blocks * words_per_block);
    let mut scales = Vec::with_capacity(n_blocks);
    let mut biases = Vec::with_capacity(n_blocks);
    for block in data.chunks_exact(block_bytes) {
        let d = f16_at(block, 0);
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let (bias, qs) = if ty == GgmlType::Q4_1 {
                    (f16_at(block, 2), &block[4..20])
                } else {
                    (exact_multiple(name, d, -8.0)?, &block[2..18])
                };
                scales.push(d);
                biases.push(bias);
                let nibble = |i: usize| -> u32 {
                    if i < 16 {
                        u32::from(qs[i] & 0x0f)
                    } else {
                        u32::from(qs[i - 16] >> 4)
                    }
                };
                for w in 0..4 {
                    let mut word = 0u32;
                    for e in 0..8 {
                        word |= nibble(8 * w + e) << (4 * e);
                    }
                    weight.push(word);
                }
            }
            GgmlType::Q8_0 => {
                scales.push(d);
                biases.push(exact_multiple(name, d, -128.0)?);
                for quad in block[2..34].chunks_exact(4) {
                    // Signed q -> unsigned q + 128 is flipping the top bit.
                    weight.push(u32::from_le_bytes([
                        quad[0] ^ 0x80,
                        quad[1] ^ 0x80,
                        quad[2] ^ 0x80,
                        quad[3] ^ 0x80,
                    ]));
                }
            }
            _ => return Err(unsupported_mlx(name, ty)),
        }
    }
    Ok(MlxQuantized {
        rows,
        cols,
        bits,
        group_size: GROUP_SIZE,
        weight,
        scales,
        biases,
    })
}

/// Dequantizes an MLX affine-quantized `[rows, cols]` matrix to f32:
/// `scale * q + bias` per element.
pub fn dequantize_mlx(
    weight: &[u32],
    scales: &[f16],
    biases: &[f16],
    bits: u32,
    group_size: usize,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let per_word = (32 / bits) as usize;
    let mask = if bits == 32 {
        u32::MAX
    } else {
        (1u32 << bits) - 1
    };
    let words_per_row = cols / per_word;
    let groups_per_row = cols / group_size;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let word = weight[r * words_per_row + c / per_word];
            let q = (word >> ((c % per_word) as u32 * bits)) & mask;
            let g = r * groups_per_row + c / group_size;
            out.push(scales[g].to_f32() * q as f32 + biases[g].to_f32());
        }
    }
    out
}

/// The ggml types [`dequantize_gguf`] and [`dequantize_into`] decode.
pub const DEQUANTIZABLE: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K, Q8_K";

/// Whether [`dequantize_into`] decodes `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q2_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K
    )
}

/// Reference dequantization of ggml data to f32, following the ggml
/// definitions of each format (see [`dequantize_into`]).
pub fn dequantize_gguf(
    name: &str,
    ty: GgmlType,
    data: &[u8],
    n_elements: usize,
) -> Result<Vec<f32>> {
    if !can_dequantize(ty) {
        return Err(unsupported(name, ty));
    }
    // `check_blocks` bounds `n_elements` by the data actually present, so a
    // hostile count cannot make this allocation large.
    check_blocks(name, ty, data, n_elements)?;
    let mut out = vec![0f32; n_elements];
    dequantize_into(name, ty, data, &mut out)?;
    Ok(out)
}

/// Checks that `data` is exactly `n_elements` of `ty` (whole blocks).
fn check_blocks(name: &str, ty: GgmlType, data: &[u8], n_elements: usize) -> Result<()> {
    let (block_elems, _) = ty.block_layout().ok_or_else(|| unsupported(name, ty))?;
    let block_elems = block_elems as usize;
    if n_elements % block_elems != 0 {
        return Err(GgufError::bad_tensor(
            name,
            format!("{n_elements} elements is not a whole number of {ty} blocks of {block_elems}"),
        ));
    }
    check_shape(name, ty, data, n_elements / block_elems, block_elems).map(|_| ())
}

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K block,
/// from its 12 packed scale bytes (ggml's `get_scale_min_k4`): sub-blocks
/// 0-3 keep their scale and min in the low 6 bits of bytes `j` and `j + 4`;
/// sub-blocks 4-7 take their low 4 bits from byte `j + 4` (scale low nibble,
/// min high nibble) and their top 2 bits from the top bits of bytes `j - 4`
/// (scale) and `j` (min).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantizes `data` (whole blocks of `ty`) into `out` (one f32 per element),
/// following ggml's definitions (`ggml-common.h` block structs and
/// `dequantize_row_*` in `ggml-quants.c`). Every product is one f32
/// operation in ggml's order, so the result is bit-identical to ggml's
/// reference and to the `gguf` Python package's `gguf.quants.dequantize`:
///
/// | type | block (bytes)                                        | value of element `i`                  |
/// |------|------------------------------------------------------|---------------------------------------|
/// | Q4_0 | d f16, qs\[16\] (32 elems)                           | `d * (nib(i) - 8)`                    |
/// | Q4_1 | d, m f16, qs\[16\]                                   | `d * nib(i) + m`                      |
/// | Q5_0 | d f16, qh u32, qs\[16\]                              | `d * ((nib(i) \| bit_i(qh) << 4) - 16)`|
/// | Q5_1 | d, m f16, qh u32, qs\[16\]                           | `d * (nib(i) \| bit_i(qh) << 4) + m`   |
/// | Q8_0 | d f16, qs i8\[32\]                                   | `d * qs[i]`                           |
/// | Q2_K | scales\[16\], qs\[64\], d, dmin f16 (256 elems)        | `(d * (sc & 15)) * q2 - dmin * (sc >> 4)` per 16 |
/// | Q4_K | d, dmin f16, scales\[12\], qs\[128\]                  | `(d * sc) * q4 - dmin * m` per 32     |
/// | Q5_K | d, dmin f16, scales\[12\], qh\[32\], qs\[128\]         | `(d * sc) * q5 - dmin * m` per 32     |
/// | Q6_K | ql\[128\], qh\[64\], scales i8\[16\], d f16            | `(d * sc) * (q6 - 32)` per 16         |
/// | Q8_K | d f32, qs i8\[256\], bsums i16\[16\]                    | `d * qs[i]`                           |
///
/// In the 32-element formats byte `j` of `qs` holds element `j` (low nibble)
/// and `j + 16` (high nibble). In Q4_K/Q5_K each 64-element chunk `c` uses
/// `qs[32c..32c+32]`, low nibbles for its first 32 elements (sub-block `2c`)
/// and high nibbles for the next (`2c + 1`); Q5_K's fifth bit of sub-block
/// `s` element `l` is bit `s` of `qh[l]`. In Q6_K and Q2_K each 128-element
/// half `h` uses `ql[64h..]`/`qh[32h..]` (Q2_K: `qs[32h..]`), the 2-bit
/// fields of a byte at shifts 0, 2, 4, 6 going to consecutive 32-element runs.
pub fn dequantize_into(name: &str, ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    if !can_dequantize(ty) {
        return Err(unsupported(name, ty));
    }
    check_blocks(name, ty, data, out.len())?;
    let (block_elems, block_bytes) = ty.block_layout().ok_or_else(|| unsupported(name, ty))?;
    let (block_elems, block_bytes) = (block_elems as usize, block_bytes as usize);
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            return Ok(());
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
            return Ok(());
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
            return Ok(());
        }
        _ => {}
    }
    for (b, y) in data
        .chunks_exact(block_bytes)
        .zip(out.chunks_exact_mut(block_elems))
    {
        match ty {
            GgmlType::Q4_0 => {
                let d = f16_at(b, 0).to_f32();
                for (j, &x) in b[2..18].iter().enumerate() {
                    y[j] = d * (f32::from(x & 0x0f) - 8.0);
                    y[j + 16] = d * (f32::from(x >> 4) - 8.0);
                }
            }
            GgmlType::Q4_1 => {
                let d = f16_at(b, 0).to_f32();
                let m = f16_at(b, 2).to_f32();
                for (j, &x) in b[4..20].iter().enumerate() {
                    y[j] = d * f32::from(x & 0x0f) + m;
                    y[j + 16] = d * f32::from(x >> 4) + m;
                }
            }
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let d = f16_at(b, 0).to_f32();
                let (m, rest) = if ty == GgmlType::Q5_1 {
                    (Some(f16_at(b, 2).to_f32()), &b[4..])
                } else {
                    (None, &b[2..])
                };
                let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                for (j, &x) in rest[4..20].iter().enumerate() {
                    let lo = (x & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
                    let hi = (x >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                    match m {
                        Some(m) => {
                            y[j] = d * f32::from(lo) + m;
                            y[j + 16] = d * f32::from(hi) + m;
                        }
                        None => {
                            y[j] = d * f32::from(lo as i8 - 16);
                            y[j + 16] = d * f32::from(hi as i8 - 16);
                        }
                    }
                }
            }
            GgmlType::Q8_0 => {
                let d = f16_at(b, 0).to_f32();
                for (o, &x) in y.iter_mut().zip(&b[2..34]) {
                    *o = d * f32::from(x as i8);
                }
            }
            GgmlType::Q2_K => {
                let scales = &b[0..16];
                let qs = &b[16..80];
                let d = f16_at(b, 80).to_f32();
                let dmin = f16_at(b, 82).to_f32();
                for (e, o) in y.iter_mut().enumerate() {
                    let (h, within) = (e / 128, e % 128);
                    let (shift, l) = (within / 32, within % 32);
                    let q = (qs[32 * h + l] >> (2 * shift)) & 3;
                    let sc = scales[e / 16];
                    let dl = d * f32::from(sc & 0x0f);
                    let ml = dmin * f32::from(sc >> 4);
                    *o = dl * f32::from(q) - ml;
                }
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let d = f16_at(b, 0).to_f32();
                let dmin = f16_at(b, 2).to_f32();
                let scales = &b[4..16];
                let (qh, qs) = if ty == GgmlType::Q5_K {
                    (Some(&b[16..48]), &b[48..176])
                } else {
                    (None, &b[16..144])
                };
                for s in 0..8 {
                    let (sc, m) = scale_min_k4(s, scales);
                    let d1 = d * f32::from(sc);
                    let m1 = dmin * f32::from(m);
                    let chunk = &qs[32 * (s / 2)..32 * (s / 2) + 32];
                    for l in 0..32 {
                        let mut q = if s % 2 == 0 {
                            chunk[l] & 0x0f
                        } else {
                            chunk[l] >> 4
                        };
                        if let Some(qh) = qh {
                            q |= ((qh[l] >> s) & 1) << 4;
                        }
                        y[32 * s + l] = d1 * f32::from(q) - m1;
                    }
                }
            }
            GgmlType::Q6_K => {
                let ql = &b[0..128];
                let qh = &b[128..192];
                let scales = &b[192..208];
                let d = f16_at(b, 208).to_f32();
                for (e, o) in y.iter_mut().enumerate() {
                    let (h, within) = (e / 128, e % 128);
                    let lo = (ql[64 * h + within % 64] >> (4 * (within / 64))) & 0x0f;
                    let hi = (qh[32 * h + within % 32] >> (2 * (within / 32))) & 3;
                    let q = (lo | (hi << 4)) as i8 - 32;
                    let dl = d * f32::from(scales[e / 16] as i8);
                    *o = dl * f32::from(q);
                }
            }
            GgmlType::Q8_K => {
                let d = f32_at(b, 0);
                for (o, &x) in y.iter_mut().zip(&b[4..260]) {
                    *o = d * f32::from(x as i8);
                }
            }
            _ => return Err(unsupported(name, ty)),
        }
    }
    Ok(())
}

fn check_heads(name: &str, rows: usize, n_head: usize, data_len: usize) -> Result<(usize, usize)> {
    if n_head == 0 || rows == 0 || rows % n_head != 0 || (rows / n_head) % 2 != 0 {
        return Err(GgufError::bad_tensor(
            name,
            format!("{rows} rows cannot be split into {n_head} heads of even size"),
        ));
    }
    if data_len % rows != 0 {
        return Err(GgufError::bad_tensor(
            name,
            format!("{data_len} bytes is not {rows} equal rows"),
        ));
    }
    Ok((rows / n_head, data_len / rows))
}

/// Undoes llama.cpp's conversion-time permutation of the q/k projection rows.
///
/// llama.cpp stores, for each head of `head_dim` rows, the rows in the order
/// obtained by viewing them as `[2, head_dim/2]` and transposing to
/// `[head_dim/2, 2]` (so its RoPE can rotate adjacent pairs). This returns the
/// original (Hugging Face / mlx-lm "rotate half") order. `data` holds `rows`
/// rows of equal byte length in any storage type; a quantized row moves as a
/// whole, so nothing is requantized.
pub fn unpermute_rows(name: &str, data: &[u8], rows: usize, n_head: usize) -> Result<Vec<u8>> {
    move_head_rows(name, data, rows, n_head, false)
}

/// llama.cpp's conversion-time permutation (the inverse of [`unpermute_rows`]).
pub fn permute_rows(name: &str, data: &[u8], rows: usize, n_head: usize) -> Result<Vec<u8>> {
    move_head_rows(name, data, rows, n_head, true)
}

/// Row `h*head_dim + 2i + j` (llama.cpp order) <-> row `h*head_dim + j*half + i`
/// (rotate-half order); `to_llama` picks the direction.
fn move_head_rows(
    name: &str,
    data: &[u8],
    rows: usize,
    n_head: usize,
    to_llama: bool,
) -> Result<Vec<u8>> {
    let (head_dim, row_bytes) = check_heads(name, rows, n_head, data.len())?;
    let half = head_dim / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let rotate_half = h * head_dim + j * half + i;
                let llama = h * head_dim + 2 * i + j;
                let (dst, src) = if to_llama {
                    (llama, rotate_half)
                } else {
                    (rotate_half, llama)
                };
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift) so the tests need no crates.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn byte(&mut self) -> u8 {
            (self.next() >> 24) as u8
        }
        fn f16(&mut self) -> f16 {
            // Finite values over a wide range, both signs, incl. subnormals.
            let exp = (self.next() % 20) as u16 + 1; // 1..=20: finite, and 128x stays finite
            let mant = (self.next() % 1024) as u16;
            let sign = (self.next() % 2) as u16;
            let sub = self.next() % 10 == 0;
            f16::from_bits(sign << 15 | if sub { 0 } else { exp << 10 } | mant)
        }
    }

    fn random_blocks(ty: GgmlType, n_blocks: usize, rng: &mut Rng) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..n_blocks {
            out.extend_from_slice(&rng.f16().to_le_bytes());
            let rest = match ty {
                GgmlType::Q4_1 => {
                    out.extend_from_slice(&rng.f16().to_le_bytes());
                    16
                }
                GgmlType::Q4_0 => 16,
                GgmlType::Q8_0 => 32,
                _ => unreachable!(),
            };
            for _ in 0..rest {
                out.push(rng.byte());
            }
        }
        out
    }

    #[test]
    fn q4_1_nibble_order_is_repacked() {
        // One block: d = 1, m = 0.5, and element i has q = i / 2, so byte j
        // holds j / 2 (element j) low and 8 + j / 2 (element j + 16) high.
        let mut block = Vec::new();
        block.extend_from_slice(&f16::from_f32(1.0).to_le_bytes());
        block.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for j in 0..16u8 {
            block.push((j / 2) | ((8 + j / 2) << 4));
        }
        let q = gguf_to_mlx("t", GgmlType::Q4_1, &block, 1, 32).unwrap();
        // MLX: element e of word w sits at bits 4e.
        assert_eq!(
            q.weight,
            vec![0x3322_1100, 0x7766_5544, 0xbbaa_9988, 0xffee_ddcc]
        );
        let expect: Vec<f32> = (0..32).map(|i| (i / 2) as f32 + 0.5).collect();
        assert_eq!(
            dequantize_gguf("t", GgmlType::Q4_1, &block, 32).unwrap(),
            expect
        );
        assert_eq!(q.dequantize(), expect);
    }

    #[test]
    fn q8_0_sign_and_order() {
        let mut block = f16::from_f32(0.5).to_le_bytes().to_vec();
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let q = gguf_to_mlx("t", GgmlType::Q8_0, &block, 1, 32).unwrap();
        assert_eq!(q.scales, vec![f16::from_f32(0.5)]);
        assert_eq!(q.biases, vec![f16::from_f32(-64.0)]);
        // element 0 is -16 -> 112 = 0x70 in the lowest byte of word 0.
        assert_eq!(q.weight[0], u32::from_le_bytes([0x70, 0x71, 0x72, 0x73]));
        let expect: Vec<f32> = (0..32).map(|i| 0.5 * (i as f32 - 16.0)).collect();
        assert_eq!(q.dequantize(), expect);
    }

    #[test]
    fn random_blocks_dequantize_identically() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols) = (5, 96);
            let data = random_blocks(ty, rows * cols / 32, &mut rng);
            let reference = dequantize_gguf("t", ty, &data, rows * cols).unwrap();
            let q = gguf_to_mlx("t", ty, &data, rows, cols).unwrap();
            assert_eq!(q.weight.len(), rows * cols * q.bits as usize / 32);
            assert_eq!(q.scales.len(), rows * cols / 32);
            let got = q.dequantize();
            for (i, (a, b)) in reference.iter().zip(&got).enumerate() {
                // Exact equality (a zero may differ in sign only, which is the same value).
                assert!(a == b, "{ty} element {i}: gguf {a} vs mlx {b}");
            }
        }
    }

    #[test]
    fn bad_sizes_and_types_are_errors() {
        let err = gguf_to_mlx("blk.0.x", GgmlType::Q4_1, &[0; 39], 1, 64).unwrap_err();
        assert!(err.to_string().contains("blk.0.x"), "{err}");
        assert!(gguf_to_mlx("t", GgmlType::Q4_1, &[0; 20], 1, 16).is_err());
        let err = gguf_to_mlx("t", GgmlType::Q4_K, &[0; 144], 1, 256).unwrap_err();
        assert!(
            matches!(err, GgufError::UnsupportedTensorType { .. }),
            "{err}"
        );
        // A Q8_0 scale whose -128x overflows f16 cannot be converted losslessly.
        let mut block = f16::from_f32(1024.0).to_le_bytes().to_vec();
        block.extend([0u8; 32]);
        assert!(gguf_to_mlx("t", GgmlType::Q8_0, &block, 1, 32).is_err());
    }

    #[test]
    fn unpermute_matches_known_orders() {
        // One head of 4 rows: llama.cpp order is [0, 2, 1, 3].
        let rows: Vec<u8> = vec![0, 2, 1, 3];
        assert_eq!(unpermute_rows("t", &rows, 4, 1).unwrap(), vec![0, 1, 2, 3]);
        // head_dim 6: llama.cpp order [0, 3, 1, 4, 2, 5]; two heads.
        let rows: Vec<u8> = vec![0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11];
        assert_eq!(
            unpermute_rows("t", &rows, 12, 2).unwrap(),
            (0..12).collect::<Vec<u8>>()
        );
        assert_eq!(
            permute_rows("t", &(0..12).collect::<Vec<u8>>(), 12, 2).unwrap(),
            rows
        );
        // Multi-byte rows move whole.
        let data: Vec<u8> = [0u8, 2, 1, 3]
            .iter()
            .flat_map(|&r| [r * 10, r * 10 + 1])
            .collect();
        assert_eq!(
            unpermute_rows("t", &data, 4, 1).unwrap(),
            vec![0, 1, 10, 11, 20, 21, 30, 31]
        );
        assert!(unpermute_rows("t", &[0; 6], 6, 4).is_err());
        assert!(unpermute_rows("t", &[0; 6], 3, 1).is_err());
    }

    /// The point of the un-permutation: llama.cpp's RoPE (rotating adjacent
    /// pairs) applied to the stored rows must equal mlx-lm's RoPE (rotating
    /// element i with i + head_dim/2) applied to the un-permuted rows.
    #[test]
    fn unpermute_turns_adjacent_pair_rope_into_rotate_half_rope() {
        let head_dim = 8;
        let n_head = 2;
        let rows = head_dim * n_head;
        let base = 10000f64;
        let pos = 3.0f64;
        let theta = |i: usize| pos * base.powf(-2.0 * i as f64 / head_dim as f64);
        // A query vector as stored by llama.cpp (one value per row).
        let stored: Vec<f64> = (0..rows)
            .map(|i| (i as f64 * 0.37).sin() + 0.1 * i as f64)
            .collect();
        let mut rope_pairs = stored.clone();
        for h in 0..n_head {
            for i in 0..head_dim / 2 {
                let (a, b) = (h * head_dim + 2 * i, h * head_dim + 2 * i + 1);
                let (c, s) = (theta(i).cos(), theta(i).sin());
                let (x, y) = (stored[a], stored[b]);
                rope_pairs[a] = x * c - y * s;
                rope_pairs[b] = x * s + y * c;
            }
        }
        let as_bytes = |v: &[f64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let from_bytes = |b: &[u8]| -> Vec<f64> {
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let hf = from_bytes(&unpermute_rows("q", &as_bytes(&stored), rows, n_head).unwrap());
        let mut rope_half = hf.clone();
        for h in 0..n_head {
            for i in 0..head_dim / 2 {
                let (a, b) = (h * head_dim + i, h * head_dim + i + head_dim / 2);
                let (c, s) = (theta(i).cos(), theta(i).sin());
                let (x, y) = (hf[a], hf[b]);
                rope_half[a] = x * c - y * s;
                rope_half[b] = x * s + y * c;
            }
        }
        let expect =
            from_bytes(&unpermute_rows("q", &as_bytes(&rope_pairs), rows, n_head).unwrap());
        for (a, b) in expect.iter().zip(&rope_half) {
            assert!((a - b).abs() < 1e-12, "{expect:?} vs {rope_half:?}");
        }
        // And the opposite direction would be wrong (head_dim 8 is not self-inverse).
        let wrong = from_bytes(&permute_rows("q", &as_bytes(&stored), rows, n_head).unwrap());
        assert_ne!(wrong, hf);
    }
}
