//! Converts the real default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0 GGUF)
//! and checks the result against the GGUF itself.

mod common;

use std::collections::BTreeSet;

use half::f16;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use weft_gguf::quant::{dequantize_gguf, dequantize_mlx};
use weft_gguf::{
    default_cache_dir, pull_default, GgmlType, GgufFile, COMPLETE_MARKER, WEIGHTS_FILE,
};

fn read_json(name: &str) -> Value {
    let path = common::model_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn pull_is_idempotent_and_marked_complete() {
    let dir = common::model_dir();
    assert!(dir.join(COMPLETE_MARKER).is_file());
    for f in [
        "config.json",
        WEIGHTS_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    let again = pull_default(&default_cache_dir(), false).expect("second pull");
    assert_eq!(again, dir);
    assert!(
        dir.ends_with("models/SmolLM2-135M-Instruct"),
        "{}",
        dir.display()
    );
}

#[test]
fn config_comes_from_gguf_metadata() {
    let c = read_json("config.json");
    let g = GgufFile::open(common::gguf_path()).expect("open gguf");
    let u = |k: &str| u64::from(g.get_u32(k).unwrap());
    assert_eq!(c["model_type"], "llama");
    assert_eq!(c["hidden_size"], u("llama.embedding_length"));
    assert_eq!(c["hidden_size"], 576);
    assert_eq!(c["num_hidden_layers"], 30);
    assert_eq!(c["intermediate_size"], 1536);
    assert_eq!(c["num_attention_heads"], 9);
    assert_eq!(c["num_key_value_heads"], 3);
    assert_eq!(c["head_dim"], 64);
    assert_eq!(c["vocab_size"], 49152);
    assert_eq!(c["rope_theta"].as_f64(), Some(100000.0));
    assert_eq!(c["rms_norm_eps"].as_f64(), Some(1e-5));
    assert_eq!(c["max_position_embeddings"], 8192);
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["bos_token_id"], 1);
    assert_eq!(c["eos_token_id"], 2);
    let q = &c["quantization"];
    assert_eq!(q["group_size"], 32);
    assert_eq!(q["bits"], 4);
    assert_eq!(
        q["model.embed_tokens"],
        serde_json::json!({"group_size": 32, "bits": 8})
    );
}

#[test]
fn tokenizer_matches_known_ids() {
    let tok = tokenizers::Tokenizer::from_file(common::model_dir().join("tokenizer.json"))
        .expect("load tokenizer.json");
    let enc = tok
        .encode("The capital of France is", false)
        .expect("encode");
    assert_eq!(enc.get_ids(), &[504, 3575, 282, 4649, 314]);
    let enc = tok
        .encode("<|im_start|>user\nWhat is 12+7?<|im_end|>\n", false)
        .expect("encode");
    assert_eq!(enc.get_ids()[0], 1);
    assert_eq!(*enc.get_ids().last().unwrap(), 198);
    assert!(enc.get_ids().contains(&2));
    assert_eq!(tok.get_vocab_size(true), 49152);
    let text = "héllo wörld 你好 🦀\n\tx  = 3.14";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);

    let tc = read_json("tokenizer_config.json");
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["add_bos_token"], false);
    let template = tc["chat_template"].as_str().expect("chat_template");
    assert!(template.contains("<|im_start|>") && template.contains("add_generation_prompt"));
    assert_eq!(tc["added_tokens_decoder"]["2"]["content"], "<|im_end|>");
    assert_eq!(tc["added_tokens_decoder"]["2"]["special"], true);
    assert_eq!(tc["added_tokens_decoder"].as_object().unwrap().len(), 17);
}

/// An un-permutation written independently of the library's, as index arithmetic
/// on llama.cpp's `reshape(n_head, 2, head_dim/2, in).swapaxes(1, 2)`.
fn unpermute_f32(values: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for dst in 0..rows {
        let (h, within) = (dst / head_dim, dst % head_dim);
        let (j, i) = (within / half, within % half);
        let src = h * head_dim + i * 2 + j;
        out[dst * cols..(dst + 1) * cols].copy_from_slice(&values[src * cols..(src + 1) * cols]);
    }
    out
}

fn as_f16(t: &safetensors::tensor::TensorView<'_>) -> Vec<f16> {
    assert_eq!(t.dtype(), Dtype::F16);
    t.data()
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect()
}

#[test]
fn every_tensor_dequantizes_to_the_gguf_values_exactly() {
    let g = GgufFile::open(common::gguf_path()).expect("open gguf");
    let bytes = std::fs::read(common::model_dir().join(WEIGHTS_FILE)).expect("read safetensors");
    let st = SafeTensors::deserialize(&bytes).expect("parse safetensors");
    let heads = g.get_u32("llama.attention.head_count").unwrap() as usize;
    let kv_heads = g.get_u32("llama.attention.head_count_kv").unwrap() as usize;

    let mut seen = BTreeSet::new();
    let mut checked = 0usize;
    let mut types = BTreeSet::new();
    for info in g.tensors() {
        let data = g.tensor_data(info).unwrap();
        let reference =
            dequantize_gguf(&info.name, info.ggml_type, data, info.n_elements as usize).unwrap();
        types.insert(info.ggml_type.name());
        let hf = if info.name == "token_embd.weight" {
            "model.embed_tokens".to_string()
        } else if info.name == "output_norm.weight" {
            "model.norm.weight".to_string()
        } else {
            let rest = info.name.strip_prefix("blk.").expect("layer tensor");
            let (layer, what) = rest.split_once('.').unwrap();
            let module = match what {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj",
                "attn_k.weight" => "self_attn.k_proj",
                "attn_v.weight" => "self_attn.v_proj",
                "attn_output.weight" => "self_attn.o_proj",
                "ffn_gate.weight" => "mlp.gate_proj",
                "ffn_up.weight" => "mlp.up_proj",
                "ffn_down.weight" => "mlp.down_proj",
                other => panic!("unexpected tensor {other}"),
            };
            format!("model.layers.{layer}.{module}")
        };
        if info.dims.len() == 1 {
            assert_eq!(info.ggml_type, GgmlType::F32);
            let t = st.tensor(&hf).unwrap_or_else(|e| panic!("{hf}: {e}"));
            assert_eq!(t.dtype(), Dtype::F32);
            assert_eq!(t.shape(), &[info.dims[0] as usize]);
            let got: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(got, reference, "{hf}");
            seen.insert(hf);
        } else {
            let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
            let reference = if info.name.ends_with("attn_q.weight") {
                unpermute_f32(&reference, rows, cols, heads)
            } else if info.name.ends_with("attn_k.weight") {
                unpermute_f32(&reference, rows, cols, kv_heads)
            } else {
                reference
            };
            let bits = match info.ggml_type {
                GgmlType::Q8_0 => 8,
                GgmlType::Q4_1 => 4,
                other => panic!("{}: unexpected type {other}", info.name),
            };
            let w = st.tensor(&format!("{hf}.weight")).unwrap();
            let s = st.tensor(&format!("{hf}.scales")).unwrap();
            let b = st.tensor(&format!("{hf}.biases")).unwrap();
            assert_eq!(w.dtype(), Dtype::U32);
            assert_eq!(w.shape(), &[rows, cols * bits / 32], "{hf}.weight");
            assert_eq!(s.shape(), &[rows, cols / 32], "{hf}.scales");
            assert_eq!(b.shape(), &[rows, cols / 32], "{hf}.biases");
            let words: Vec<u32> = w
                .data()
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let got = dequantize_mlx(
                &words,
                &as_f16(&s),
                &as_f16(&b),
                bits as u32,
                32,
                rows,
                cols,
            );
            assert_eq!(got.len(), reference.len());
            let bad = got.iter().zip(&reference).position(|(a, r)| a != r);
            assert!(
                bad.is_none(),
                "{hf}: element {:?} differs: mlx {} vs gguf {}",
                bad,
                got[bad.unwrap_or(0)],
                reference[bad.unwrap_or(0)]
            );
            for suffix in ["weight", "scales", "biases"] {
                seen.insert(format!("{hf}.{suffix}"));
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 272);
    assert_eq!(
        types,
        ["F32", "Q4_1", "Q8_0"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
    let written: BTreeSet<String> = st.names().into_iter().map(String::from).collect();
    assert_eq!(
        written, seen,
        "safetensors holds exactly the converted tensors"
    );
}
