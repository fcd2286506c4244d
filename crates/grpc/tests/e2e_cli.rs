//! The `weft` binary's serve-related commands that need no model: refusals
//! at startup and `weft hash-key`.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn weft() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weft"));
    c.env("NO_COLOR", "1").stdin(Stdio::null());
    // Keep WEFT_* from the caller's environment out of these checks.
    for (k, _) in std::env::vars() {
        if k.starts_with("WEFT_") && k != "WEFT_HOME" {
            c.env_remove(k);
        }
    }
    c
}

/// Runs to completion (bounded), returns (success, stdout, stderr).
fn run(mut c: Command) -> (bool, String, String) {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(60));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn open_server_refuses_non_loopback() {
    let mut c = weft();
    c.args(["serve", "--listen", "0.0.0.0:0", "--metrics-listen", "off"]);
    let (ok, stdout, stderr) = run(c);
    assert!(!ok);
    assert!(stderr.contains("without a tenant file"), "{stderr}");
    assert!(stderr.contains("--tenants"), "{stderr}");
    // It refused before binding or loading anything.
    assert!(!stdout.contains("listening"), "{stdout}");
    // The same through the environment.
    let mut c = weft();
    c.args(["serve", "--metrics-listen", "off"])
        .env("WEFT_LISTEN", "0.0.0.0:0");
    let (ok, _, stderr) = run(c);
    assert!(!ok && stderr.contains("without a tenant file"), "{stderr}");
    // The HTTP API follows the same rule.
    let mut c = weft();
    c.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
        "--http-listen",
        "0.0.0.0:0",
    ]);
    let (ok, stdout, stderr) = run(c);
    assert!(!ok && stderr.contains("HTTP API"), "{stderr}");
    assert!(!stdout.contains("listening"), "{stdout}");
    // And the metrics listener (issue 17: it used to bind 0.0.0.0 regardless).
    let mut c = weft();
    c.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "off",
        "--metrics-listen",
        "0.0.0.0:0",
    ]);
    let (ok, stdout, stderr) = run(c);
    assert!(
        !ok && stderr.contains("metrics on 0.0.0.0:0 without a tenant file"),
        "{stderr}"
    );
    assert!(!stdout.contains("listening"), "{stdout}");
}

#[test]
fn bad_tenant_file_and_config_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("tenants.toml");
    std::fs::write(
        &t,
        "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"not-a-hash\"\n",
    )
    .unwrap();
    let mut c = weft();
    c.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
        "--tenants",
    ])
    .arg(&t);
    let (ok, _, stderr) = run(c);
    assert!(!ok);
    assert!(stderr.contains("sha256"), "{stderr}");

    let cfg = dir.path().join("weft.toml");
    std::fs::write(&cfg, "max_batch_rows = 0\n").unwrap();
    let mut c = weft();
    c.args(["serve", "--config"]).arg(&cfg);
    let (ok, _, stderr) = run(c);
    assert!(!ok);
    assert!(stderr.contains("max-batch-rows"), "{stderr}");

    let mut c = weft();
    c.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--drain-timeout",
        "soon",
    ]);
    let (ok, _, stderr) = run(c);
    assert!(!ok && stderr.contains("duration"), "{stderr}");

    for (args, says) in [
        (&["--kv-bits", "3"][..], "--kv-bits 3: 4 or 8 bits"),
        (
            &["--kv-bits", "4", "--kv-group-size", "16"][..],
            "--kv-group-size 16",
        ),
        (&["--kv-group-size", "32"][..], "needs --kv-bits"),
    ] {
        let mut c = weft();
        c.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
        ])
        .args(args);
        let (ok, _, stderr) = run(c);
        assert!(!ok && stderr.contains(says), "{args:?}: {stderr}");
    }
}

#[test]
fn hash_key_prints_sha256_hex() {
    let mut c = weft();
    c.args(["hash-key", "test"]);
    let (ok, stdout, _) = run(c);
    assert!(ok);
    assert_eq!(
        stdout.trim(),
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    );
    // From stdin, so the key stays out of shell history.
    let mut child = Command::new(env!("CARGO_BIN_EXE_weft"))
        .arg("hash-key")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"test\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    );
}

#[test]
fn serve_help_explains_the_options() {
    let mut c = weft();
    c.args(["serve", "--help"]);
    let (ok, stdout, _) = run(c);
    assert!(ok);
    for flag in [
        "--listen",
        "--metrics-listen",
        "--http-listen",
        "--model",
        "--tenants",
        "--config",
        "--max-batch-rows",
        "--max-waiting",
        "--prefill-chunk",
        "--kv-blocks",
        "--kv-block-size",
        "--kv-memory",
        "--drain-timeout",
        "--compute-dtype",
        "--weights",
        "WEFT_LISTEN",
        "WEFT_TENANTS",
        "127.0.0.1:50051",
        "127.0.0.1:9464",
    ] {
        assert!(
            stdout.contains(flag),
            "{flag} missing from serve --help:\n{stdout}"
        );
    }
}
