//! One Gated DeltaNet layer (Qwen3.5's linear attention) against mlx-lm's
//! `qwen3_5.GatedDeltaNet` on a random fixture: outputs and both states after a
//! first call from the zero state, then after a second call continuing it.

mod common;

use common::*;
use weft_models::gated_delta::{DeltaShape, GatedDeltaNet};
use weft_models::weights::Weights;
use weft_models::{Kernels, WeightPolicy};

#[test]
fn a_gated_deltanet_layer_matches_mlx_lm_across_two_calls() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("m");
    oracle(&[
        "fixture",
        "--arch",
        "qwen3_5",
        "--out",
        md.to_str().unwrap(),
    ]);
    let dump = dir.path().join("gdn.safetensors");
    oracle(&[
        "gdn-layer",
        "--model",
        md.to_str().unwrap(),
        "--out",
        dump.to_str().unwrap(),
    ]);
    let mut w = Weights::load_dir(&md).unwrap();
    let shape = DeltaShape {
        k_heads: 2,
        v_heads: 4,
        k_dim: 32,
        v_dim: 32,
        kernel: 4,
    };
    let policy = WeightPolicy {
        dequantize: true,
        dtype: mlx_rs::Dtype::Float32,
        kernels: Kernels::Stock,
        host_gemm: false,
    };
    let layer = GatedDeltaNet::load(
        &mut w,
        "language_model.model.layers.0.linear_attn",
        shape,
        1e-6,
        policy,
        |_| None,
    )
    .unwrap();
    let want = mlx_rs::Array::load_safetensors(&dump).unwrap();
    let get = |k: &str| {
        want.get(k)
            .unwrap_or_else(|| panic!("{k} in the dump"))
            .clone()
    };
    let zero = shape.zero_state(2, mlx_rs::Dtype::Float32).unwrap();
    let (y1, s1) = layer.forward(&get("x1"), &zero, None).unwrap();
    let (y2, s2) = layer.forward(&get("x2"), &s1, None).unwrap();
    for (what, got, k) in [
        ("first output", &y1, "y1"),
        ("conv state after the first call", &s1[0], "conv1"),
        ("recurrent state after the first call", &s1[1], "rec1"),
        ("second output", &y2, "y2"),
        ("conv state after the second call", &s2[0], "conv2"),
        ("recurrent state after the second call", &s2[1], "rec2"),
    ] {
        let (g, w) = (to_vec_f32(got), to_vec_f32(&get(k)));
        assert_eq!(g.len(), w.len(), "{what}: sizes");
        let d = max_abs_diff(&g, &w);
        eprintln!("{what}: max |diff| {d:.2e}");
        assert!(d < 1e-4, "{what}: differs from mlx-lm by {d}");
    }
}
