//! Every variant of Weft's few-row product kernels (`weft_models::gemv`) that a
//! decode step can launch compiles with NVRTC for sm_90 (the H200), without
//! warnings and without register spills, wrapped as MLX's custom-kernel path
//! wraps it (`tests/cuda/nvrtc_check.py`, NVRTC from the test venv's
//! `nvidia-cuda-nvrtc-cu12`). No GPU is needed: this is what catches a kernel
//! source broken for some row count, mode or dtype before a GPU run does. The
//! kernels' numbers are checked on the GPU (`benches/gemv_probe.py`, the
//! decode-step checks in benches/gpu_decode.sh).

mod common;

use serde_json::json;

#[test]
fn every_gemv_and_mma_variant_compiles_for_sm90_without_spills() {
    let mut spec = Vec::new();
    for k in weft_models::gemv::kernel_sources() {
        let dtypes: &[&str] = match (k.mma, k.quantized) {
            // The tensor-core kernels take bf16 and f16 (their mma types).
            (true, _) => &["__nv_bfloat16", "__half"],
            // 4-bit weights come with 2-byte activations; dense ones with any.
            (false, true) => &["__nv_bfloat16", "__half"],
            (false, false) => &["__nv_bfloat16", "float"],
        };
        // Rows: the tensor-core kernels are built for 8 and 16 (the capacity
        // `gemv::mma_capacity` pads 2-16 rows to; the count itself is read at
        // run time); the CUDA-core ones one row, and several where those cannot.
        let variants: Vec<(i32, i32)> = if k.mma {
            [2, 5, 8, 9, 16]
                .iter()
                .map(|&b| (weft_models::gemv::mma_capacity(b), 0))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect()
        } else {
            vec![(1, 1), (2, 4), (3, 4), (4, 4), (4, 2), (4, 1)]
        };
        for &dt in dtypes {
            for &(nb, nc) in &variants {
                for norm in 0..2 {
                    for epi in 0..3 {
                        let mut consts = vec![
                            json!(["NB", nb]),
                            json!(["ROWS_RT", i32::from(k.mma)]),
                            json!(["NORM", norm]),
                            json!(["EPI", epi]),
                        ];
                        consts.push(if k.mma {
                            json!(["BF16", i32::from(dt == "__nv_bfloat16")])
                        } else {
                            json!(["NC", nc])
                        });
                        if k.quantized {
                            consts.push(json!(["G", 64]));
                        }
                        let inputs: Vec<_> = k
                            .inputs
                            .iter()
                            .map(|&n| {
                                let t = match n {
                                    "w" if k.quantized => "uint32_t",
                                    "eps" => "float",
                                    _ => dt,
                                };
                                json!([n, t])
                            })
                            .collect();
                        spec.push(json!({
                            "name": k.name,
                            "inputs": inputs,
                            "outputs": [["y", dt]],
                            "consts": consts,
                            "types": [["DT", dt]],
                            "source": k.source,
                        }));
                    }
                }
            }
        }
    }
    check(&spec);
}

/// The fused decode layer's kernels that read a projection's output
/// (`decode_kernels::Consumer`: residual add + RMS norm, RoPE of the fused
/// QKV, SwiGLU of the fused gate/up), plain and with the LoRA expand of one
/// to all of the projection's parts read in (`decode_kernels::lora_prelude`),
/// each dtype, ranks 16, 12, 8 and 64; the add-norm and SwiGLU kernels also
/// with the next projection's LoRA shrink (1024 threads a row, the default),
/// and the add-norm kernel with the output projection's shrink in its prologue.
#[test]
fn the_fused_decode_kernels_compile_for_sm90_without_spills() {
    use weft_models::decode_kernels::*;
    let mut spec = Vec::new();
    for c in Consumer::ALL {
        // Column (offset, width) of each part, as the 1.2B model's
        // projections have them.
        let cols: &[(i32, i32)] = match c {
            Consumer::AddNorm => &[(0, 2048)],
            Consumer::RopeQkv => &[(0, 2048), (2048, 256), (2304, 256)],
            Consumer::SiluMul => &[(0, 5632), (5632, 5632)],
        };
        // The add-norm kernel also with the next projection's LoRA shrink
        // (1-3 parts), the SwiGLU one with the down projection's (1).
        let shrinks = match c {
            Consumer::AddNorm => 0..=3,
            Consumer::SiluMul => 0..=1,
            Consumer::RopeQkv => 0..=0,
        };
        for (parts, shrink) in
            (0..=c.max_parts()).flat_map(|p| shrinks.clone().map(move |q| (p, q)))
        {
            for (dt, rank) in [
                ("__nv_bfloat16", 16),
                ("__half", 12),
                ("__half", 8),
                ("float", 64),
            ] {
                let k = c.source_with_shrink(parts, shrink);
                let mut consts = Vec::new();
                if c == Consumer::RopeQkv {
                    consts.extend([json!(["HQ", 32]), json!(["KVH", 4]), json!(["HD", 64])]);
                }
                if parts > 0 {
                    consts.extend([json!(["LP", parts]), json!(["LS", 9]), json!(["LR", rank])]);
                    for (i, &(off, w)) in cols[..parts].iter().enumerate() {
                        consts.push(json!([format!("LOFF{i}"), off]));
                        consts.push(json!([format!("LW{i}"), w]));
                    }
                }
                if shrink > 0 {
                    // The shrink's loads: where a rank does not split into
                    // them the model shrinks by a matmul, never this variant.
                    let Some(sv) = ShrinkIn::vector(rank, dtype_of(dt)) else {
                        continue;
                    };
                    consts.extend([
                        json!(["SQ", shrink]),
                        json!(["SS", 9]),
                        json!(["SR", rank]),
                        json!(["SV", sv]),
                        json!(["ST", 1024]),
                    ]);
                }
                spec.push(variant(k, consts, dt));
            }
        }
    }
    // The add-norm kernel with the output projection's shrink and expand
    // in its prologue, with the next projection's shrink or without.
    for shrink in 0..=3 {
        for (dt, rank) in [("__nv_bfloat16", 16), ("__half", 8), ("float", 64)] {
            let sv = ShrinkIn::vector(rank, dtype_of(dt)).expect("a rank the loads split");
            let k = add_norm_prologue_source(shrink);
            let mut consts = vec![
                json!(["LS", 9]),
                json!(["LR", rank]),
                json!(["LOFF0", 0]),
                json!(["LW0", 2048]),
                json!(["PV", sv]),
                json!(["ST", 1024]),
            ];
            if shrink > 0 {
                consts.extend([
                    json!(["SQ", shrink]),
                    json!(["SS", 9]),
                    json!(["SR", rank]),
                    json!(["SV", sv]),
                ]);
            }
            spec.push(variant(k, consts, dt));
        }
    }
    check(&spec);
}

/// The paged decode-attention kernel (`paged_attention::decode_source`) over
/// dense pools and over quantized ones (4 and 8 bits, groups of 32 and 64),
/// for each head size it serves, KV-group width and dtype.
#[test]
fn the_paged_decode_kernels_compile_for_sm90_without_spills() {
    use weft_models::paged_attention::{decode_inputs, decode_source};
    let mut spec = Vec::new();
    let quants: [Option<(i32, i32)>; 5] = [
        None,
        Some((4, 32)),
        Some((4, 64)),
        Some((8, 32)),
        Some((8, 64)),
    ];
    for quant in quants {
        for (dt, hd, gq) in [
            ("__nv_bfloat16", 64, 8),
            ("__half", 128, 4),
            ("float", 256, 1),
        ] {
            let inputs: Vec<_> = decode_inputs(quant.is_some())
                .into_iter()
                .map(|n| {
                    let t = match n {
                        "k_packed" | "v_packed" => "uint32_t",
                        "table" | "start" | "ntok" => "int32_t",
                        "scale" => "float",
                        _ => dt,
                    };
                    json!([n, t])
                })
                .collect();
            let mut consts = vec![
                json!(["HD", hd]),
                json!(["BS", 16]),
                json!(["KVH", 4]),
                json!(["GQ", gq]),
            ];
            if let Some((bits, g)) = quant {
                consts.extend([json!(["BITS", bits]), json!(["G", g])]);
            }
            spec.push(json!({
                "name": if quant.is_some() { "weft_paged_decode_quantized" } else { "weft_paged_decode" },
                "inputs": inputs,
                "outputs": [["o_part", "float"], ["m_part", "float"], ["l_part", "float"]],
                "consts": consts,
                "types": [["DT", dt]],
                "source": decode_source(quant.is_some()),
            }));
        }
    }
    check(&spec);
}

/// The checker's entry for kernel `k` in dtype `dt` (a CUDA type name):
/// its inputs in `dt` but the slots, positions and f32 scalars.
fn variant(
    k: weft_models::decode_kernels::KernelSource,
    consts: Vec<serde_json::Value>,
    dt: &str,
) -> serde_json::Value {
    let inputs: Vec<_> = k
        .inputs
        .iter()
        .map(|n| {
            let t = match n.as_str() {
                "lslots" | "sslots" => "uint32_t",
                "start" => "int32_t",
                "eps" | "inv_freq" | "scale" => "float",
                _ => dt,
            };
            json!([n, t])
        })
        .collect();
    let outputs: Vec<_> = k.outputs.iter().map(|o| json!([o, dt])).collect();
    json!({
        "name": k.name,
        "inputs": inputs,
        "outputs": outputs,
        "consts": consts,
        "types": [["DT", dt]],
        "source": k.source,
    })
}

/// MLX's dtype of a CUDA type name.
fn dtype_of(dt: &str) -> mlx_rs::Dtype {
    match dt {
        "__nv_bfloat16" => mlx_rs::Dtype::Bfloat16,
        "__half" => mlx_rs::Dtype::Float16,
        _ => mlx_rs::Dtype::Float32,
    }
}

/// Runs `tests/cuda/nvrtc_check.py` over `spec`; fails on any failed variant.
fn check(spec: &[serde_json::Value]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("spec.json");
    std::fs::write(&path, serde_json::to_vec(&spec).expect("spec")).expect("write spec");
    let script = common::workspace_root().join("tests/cuda/nvrtc_check.py");
    let out = std::process::Command::new(common::python())
        .arg(&script)
        .arg(&path)
        .output()
        .expect("run nvrtc_check.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "some kernel variants failed (see above): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("{} variants, 0 failed", spec.len())),
        "the checker did not report every variant"
    );
}
