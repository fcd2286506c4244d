//! Dequantization against an independent reference: the `gguf` Python
//! package (llama.cpp's own, pinned in tests/oracle/requirements.txt), whose
//! `gguf.quants.dequantize` is a numpy port of ggml's reference C code.
//! Run by `dequant_oracle.py` with the Python from `$WEFT_PYTHON` (default
//! `<workspace>/.venv/bin/python`). Every value must be bit-identical (f32).
//!
//! Random blocks of every type both sides decode (all byte patterns: scales
//! over the whole finite f16 range, both signs, subnormals). Real tensors of
//! the Gemma 3 GGUF are compared the same way in `gemma3_model.rs`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use half::f16;
use weft_gguf::quant::dequantize_gguf;
use weft_gguf::GgmlType;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/dequant_oracle.py")
}

fn run_oracle(args: &[&std::ffi::OsStr]) -> String {
    let py = common::python();
    assert!(
        py.is_file(),
        "Python {} not found: run scripts/setup.sh (the oracle venv) or set WEFT_PYTHON",
        py.display()
    );
    let out = Command::new(&py)
        .arg(script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()));
    assert!(
        out.status.success(),
        "dequant_oracle.py failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn scratch(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dequant-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Bit-exact comparison; a NaN must be a NaN on both sides.
fn assert_same(what: &str, ours: &[f32], reference: &[f32]) {
    assert_eq!(ours.len(), reference.len(), "{what}: lengths differ");
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        let same =
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) || (*a == 0.0 && *b == 0.0);
        assert!(
            same,
            "{what} element {i}: ours {a:e} ({:#010x}), reference {b:e} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

/// xorshift64, so the test needs no crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A finite f16 (any exponent but the all-ones one), both signs.
    fn f16_bytes(&mut self) -> [u8; 2] {
        loop {
            let bits = self.next() as u16;
            if (bits >> 10) & 0x1f != 0x1f {
                return f16::from_bits(bits).to_le_bytes();
            }
        }
    }
}

/// Byte offsets of the f16 fields of one block (the rest is payload).
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

#[test]
fn random_blocks_match_gguf_py_bit_for_bit() {
    let dir = scratch("random");
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let (block_elems, block_bytes) = ty.block_layout().unwrap();
        let n_blocks = 512usize;
        let mut data = Vec::with_capacity(n_blocks * block_bytes as usize);
        for _ in 0..n_blocks {
            let start = data.len();
            data.extend((0..block_bytes).map(|_| rng.next() as u8));
            for &at in f16_fields(ty) {
                let b = rng.f16_bytes();
                data[start + at..start + at + 2].copy_from_slice(&b);
            }
        }
        let input = dir.join(format!("{}.bin", ty.name()));
        let output = dir.join(format!("{}.f32", ty.name()));
        std::fs::write(&input, &data).unwrap();
        run_oracle(&[
            "blocks".as_ref(),
            ty.name().as_ref(),
            input.as_os_str(),
            output.as_os_str(),
        ]);
        let reference = read_f32(&output);
        let ours = dequantize_gguf("random", ty, &data, n_blocks * block_elems as usize).unwrap();
        assert_same(&ty.name(), &ours, &reference);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
