//! Compares the converted `tokenizer.json` with an independent reference:
//! transformers' own GGUF tokenizer conversion, run by `tokenizer_oracle.py`
//! with the Python from `$WEFT_PYTHON` (default: `<workspace>/.venv/bin/python`,
//! which needs `transformers` and `gguf` installed).

mod common;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn python() -> PathBuf {
    match std::env::var_os("WEFT_PYTHON").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => common::workspace_root().join(".venv/bin/python"),
    }
}

#[test]
fn ids_match_transformers_gguf_tokenizer() {
    let py = python();
    assert!(
        py.is_file(),
        "Python interpreter {} not found: run .ci/run (which creates .venv with transformers and gguf) \
         or set WEFT_PYTHON to a Python that has `transformers` and `gguf` installed",
        py.display()
    );
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/tokenizer_oracle.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(common::gguf_path())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()));
    assert!(
        out.status.success(),
        "{} {} failed ({}):\n{}\n(run .ci/run or set WEFT_PYTHON to a Python with transformers and gguf)",
        py.display(),
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("oracle prints JSON");
    let cases = report["cases"].as_array().expect("cases");
    assert!(
        cases.len() >= 20,
        "oracle returned only {} cases",
        cases.len()
    );
    assert_eq!(report["vocab_size"], 49152);

    let tok = tokenizers::Tokenizer::from_file(common::model_dir().join("tokenizer.json"))
        .expect("load tokenizer.json");
    let ids_of = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect()
    };
    let mut mismatches = Vec::new();
    let mut unpatched_differs = 0;
    for case in cases {
        let text = case["text"].as_str().expect("text");
        // transformers without llama.cpp's digits-first split (see the script's
        // docstring) may only differ where whitespace runs into a digit.
        if case["ids_unpatched"] != case["ids"] {
            unpatched_differs += 1;
            let chars: Vec<char> = text.chars().collect();
            assert!(
                chars.windows(2).any(|w| w[0].is_whitespace() && w[1].is_numeric()),
                "unpatched transformers differs on {text:?}, which has no whitespace before a digit"
            );
        }
        for (key, special) in [("ids", false), ("ids_with_special", true)] {
            let want = ids_of(&case[key]);
            let got = tok
                .encode(text, special)
                .expect("encode")
                .get_ids()
                .to_vec();
            if got != want {
                mismatches.push(format!(
                    "{text:?} ({key}): ours {got:?}, reference {want:?}"
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "tokenizer differs from transformers {} ({}):\n{}",
        report["transformers_version"],
        report["route"],
        mismatches.join("\n")
    );
    eprintln!(
        "{} cases identical to transformers {} via {} (pre-tokenizer {} filled in: {}; \
         unpatched transformers differs on {unpatched_differs})",
        cases.len(),
        report["transformers_version"],
        report["route"],
        report["gguf_pre_tokenizer"],
        report["patched_pre_tokenizer"],
    );
}
