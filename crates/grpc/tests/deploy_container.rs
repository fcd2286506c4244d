//! The container builds (deploy/Containerfile for the CPU,
//! deploy/Containerfile.cuda for MLX's CUDA build) stay true to the project:
//! no CI here runs podman or docker, so these checks read the files. The build
//! stage installs scripts/setup.sh's build packages and builds `weft-grpc`;
//! the CPU runtime installs its run packages; the runtime runs `weft serve` as
//! a non-root user, EXPOSEs the CLI's default ports, and its default args parse
//! with the server's own CLI; libmlx is where LD_LIBRARY_PATH points (the CPU
//! wheel's layout as mlx-sys's build left it here; the CUDA wheel at the MLX
//! version Weft pins); the model is pulled into the WEFT_HOME the runtime uses.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser;
use weft_grpc::server::config::{
    Settings, DEFAULT_HTTP_LISTEN, DEFAULT_LISTEN, DEFAULT_METRICS_LISTEN,
};
use weft_grpc::server::ServeArgs;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

#[derive(Debug)]
struct Stage {
    image: String,
    name: Option<String>,
    /// (instruction, arguments), continuation lines joined.
    instrs: Vec<(String, String)>,
}

impl Stage {
    fn all(&self, instr: &str) -> impl Iterator<Item = &str> + '_ {
        let instr = instr.to_string();
        self.instrs
            .iter()
            .filter(move |(i, _)| *i == instr)
            .map(|(_, a)| a.as_str())
    }

    fn last(&self, instr: &str) -> &str {
        self.all(instr)
            .last()
            .unwrap_or_else(|| panic!("no {instr} in the stage from {}", self.image))
    }

    /// Packages its `apt-get install` commands name.
    fn apt(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for run in self.all("RUN") {
            for cmd in run.split("&&").flat_map(|c| c.split(';')) {
                let words: Vec<&str> = cmd.split_whitespace().collect();
                if let Some(i) = words
                    .windows(2)
                    .position(|w| w[0] == "apt-get" && w[1] == "install")
                {
                    out.extend(
                        words[i + 2..]
                            .iter()
                            .filter(|w| !w.starts_with('-'))
                            .map(|w| w.to_string()),
                    );
                }
            }
        }
        out
    }

    /// `ENV` values (`ENV K=V K2=V2` form).
    fn env(&self, key: &str) -> Option<String> {
        self.all("ENV")
            .flat_map(|a| a.split_whitespace())
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, _)| *k == key)
            .map(|(_, v)| v.trim_matches('"').to_string())
            .last()
    }

    /// `COPY --from=<stage> <src> <dst>`: (stage, src, dst).
    fn copies_from(&self) -> Vec<(String, String, String)> {
        self.all("COPY")
            .filter_map(|a| {
                let words: Vec<&str> = a.split_whitespace().collect();
                let from = words.iter().find_map(|w| w.strip_prefix("--from="))?;
                let paths: Vec<&str> = words
                    .iter()
                    .copied()
                    .filter(|w| !w.starts_with("--"))
                    .collect();
                match paths.as_slice() {
                    [src, dst] => Some((from.to_string(), src.to_string(), dst.to_string())),
                    _ => None,
                }
            })
            .collect()
    }
}

/// The stages of a Containerfile.
fn stages(rel: &str) -> Vec<Stage> {
    let text = read(rel);
    let mut logical = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && cur.is_empty()) {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(t);
            logical.push(std::mem::take(&mut cur));
        }
    }
    assert!(cur.is_empty(), "{rel}: a continuation at the end");
    let mut out: Vec<Stage> = Vec::new();
    for l in logical.iter().filter(|l| !l.is_empty()) {
        let (instr, args) = l.split_once(char::is_whitespace).unwrap_or((l, ""));
        let instr = instr.to_ascii_uppercase();
        let args = args.trim().to_string();
        if instr == "FROM" {
            let words: Vec<&str> = args.split_whitespace().collect();
            let name = match words.as_slice() {
                [_, as_, n] if as_.eq_ignore_ascii_case("as") => Some(n.to_string()),
                [_] => None,
                _ => panic!("{rel}: FROM {args}"),
            };
            out.push(Stage {
                image: words[0].to_string(),
                name,
                instrs: Vec::new(),
            });
        } else {
            out.last_mut()
                .unwrap_or_else(|| panic!("{rel}: {instr} before FROM"))
                .instrs
                .push((instr, args));
        }
    }
    out
}

/// A shell variable's words in scripts/setup.sh (`name="a b c"`).
fn setup_group(name: &str) -> BTreeSet<String> {
    let text = read("scripts/setup.sh");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=\"")))
        .unwrap_or_else(|| panic!("scripts/setup.sh sets no {name}"));
    let words: BTreeSet<String> = line
        .trim_end_matches('"')
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert!(!words.is_empty());
    words
}

fn port(addr: &str) -> u16 {
    addr.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// An exec-form instruction's JSON array.
fn exec_form(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("not exec form ({e}): {args}"))
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// Checks what both images share; returns (build stage, runtime stage).
fn check_common(rel: &str) -> (Stage, Stage, Vec<Stage>) {
    let mut all = stages(rel);
    assert!(all.len() >= 2, "{rel}: multi-stage");
    for s in &all {
        let tag = s.image.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
        assert!(
            !tag.is_empty() && tag != "latest",
            "{rel}: {} is not pinned to a tag",
            s.image
        );
        assert!(s.image.ends_with("-bookworm") || s.image.ends_with(":bookworm-slim"));
    }
    let build = all.remove(0);
    let runtime = all.pop().unwrap();
    assert_eq!(build.name.as_deref(), Some("build"), "{rel}");
    assert!(
        build.image.starts_with("docker.io/library/rust:") && build.image.ends_with("-bookworm"),
        "{rel}: Debian bookworm's rust image builds, as on a setup.sh machine"
    );
    assert_eq!(
        runtime.image, "docker.io/library/debian:bookworm-slim",
        "{rel}"
    );

    // The build stage installs what setup.sh installs to build.
    let apt = build.apt();
    for p in setup_group("build_pkgs") {
        assert!(apt.contains(&p), "{rel}: the build stage lacks {p}");
    }
    assert!(
        build
            .all("RUN")
            .any(|r| r.contains("cargo build --release") && r.contains("-p weft-grpc")),
        "{rel}: builds weft-grpc in release"
    );

    // Runtime: non-root, the binary, `weft serve`, the CLI's default ports.
    let user = runtime.last("USER");
    let uid = user.split(':').next().unwrap();
    assert!(uid != "0" && uid != "root", "{rel}: USER {user}");
    let entry = exec_form(runtime.last("ENTRYPOINT"));
    assert_eq!(entry[1..], ["serve"], "{rel}");
    let copies = runtime.copies_from();
    assert!(
        copies.iter().any(|(from, src, dst)| from == "build"
            && src.ends_with("/target/release/weft")
            && *dst == entry[0]),
        "{rel}: the entrypoint is the binary the build stage made"
    );
    let exposed: BTreeSet<u16> = runtime
        .all("EXPOSE")
        .flat_map(|a| a.split_whitespace())
        .map(|p| p.trim_end_matches("/tcp").parse().unwrap())
        .collect();
    let defaults: BTreeSet<u16> = [DEFAULT_LISTEN, DEFAULT_HTTP_LISTEN, DEFAULT_METRICS_LISTEN]
        .iter()
        .map(|a| port(a))
        .collect();
    assert_eq!(exposed, defaults, "{rel}: EXPOSE the CLI's default ports");
    // The default args: the server's CLI takes them, they bind what is
    // exposed off loopback, and so name a tenant file.
    let cmd = exec_form(runtime.last("CMD"));
    let cli = Cli::try_parse_from(std::iter::once("serve".to_string()).chain(cmd.clone()))
        .unwrap_or_else(|e| panic!("{rel}: weft serve {cmd:?}: {e}"));
    let s = Settings::resolve(cli.serve).unwrap();
    s.check_exposure()
        .expect("the default args pass the exposure check");
    let bound: BTreeSet<u16> = [Some(s.listen), s.http_listen, s.metrics_listen]
        .into_iter()
        .flatten()
        .map(|a| {
            assert!(
                a.ip().is_unspecified(),
                "{rel}: {a} is not reachable from outside"
            );
            a.port()
        })
        .collect();
    assert_eq!(bound, exposed, "{rel}");

    // The default model is pulled into the WEFT_HOME the runtime uses.
    let home = runtime.env("WEFT_HOME").expect("WEFT_HOME");
    assert!(
        build
            .all("RUN")
            .any(|r| r.contains(&format!("WEFT_HOME={home} ")) && r.contains("weft pull")),
        "{rel}: weft pull into {home}"
    );
    assert!(copies
        .iter()
        .any(|(from, src, dst)| from == "build" && *src == home && *dst == home));
    (build, runtime, all)
}

/// `LD_LIBRARY_PATH` names `<dir>/mlx/lib`, and `<dir>` is copied from `stage`.
fn check_libmlx(rel: &str, runtime: &Stage, stage: &str) -> String {
    let ld = runtime.env("LD_LIBRARY_PATH").expect("LD_LIBRARY_PATH");
    let lib = ld.split(':').next().unwrap();
    let dir = lib
        .strip_suffix("/mlx/lib")
        .unwrap_or_else(|| panic!("{rel}: LD_LIBRARY_PATH {ld} is not <wheel dir>/mlx/lib"));
    assert!(
        runtime
            .copies_from()
            .iter()
            .any(|(from, src, dst)| from == stage && src == dir && dst == dir),
        "{rel}: {dir} copied from {stage}"
    );
    dir.to_string()
}

#[test]
fn the_cpu_image_builds_and_runs_what_weft_needs() {
    let rel = "deploy/Containerfile";
    let (build, runtime, _) = check_common(rel);
    let apt = runtime.apt();
    for p in setup_group("run_pkgs") {
        assert!(apt.contains(&p), "{rel}: the runtime lacks {p}");
    }
    // libmlx comes from the wheel mlx-sys's build unpacked: the layout the
    // build stage copies is the one this build tree has.
    let dir = check_libmlx(rel, &runtime, "build");
    assert!(
        build.all("RUN").any(
            |r| r.contains("target/release/build/mlx-sys-*/out/mlx-wheel")
                && r.contains("/mlx/lib/libmlx.so")
                && r.contains(&format!("{dir}/"))
        ),
        "{rel}: copies mlx-sys's wheel to {dir}"
    );
    if std::env::var_os("MLX_PREFIX").is_some() {
        // mlx-sys linked a given MLX install: no wheel layout to compare.
        eprintln!("MLX_PREFIX set: the wheel layout is not checked");
        return;
    }
    let profile_dir = Path::new(env!("CARGO_BIN_EXE_weft")).parent().unwrap();
    let found = std::fs::read_dir(profile_dir.join("build"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("mlx-sys-"))
        .any(|e| e.path().join("out/mlx-wheel/mlx/lib/libmlx.so").is_file());
    assert!(
        found,
        "mlx-sys's build left no out/mlx-wheel/mlx/lib/libmlx.so"
    );
}

#[test]
fn the_cuda_image_puts_mlx_cuda_on_the_library_path() {
    let rel = "deploy/Containerfile.cuda";
    let (_, runtime, middle) = check_common(rel);
    // The MLX version Weft links (mlx-sys's pinned CPU wheel, the oracle's mlx).
    let build_rs = read("crates/mlx-sys/build.rs");
    let version = build_rs
        .split("mlx_cpu-")
        .nth(1)
        .and_then(|s| s.split('-').next())
        .expect("mlx-sys pins an mlx_cpu wheel");
    assert!(read("tests/oracle/requirements.txt").contains(&format!("mlx[cpu]=={version}\n")));
    let pip = middle
        .iter()
        .find_map(|s| {
            s.all("RUN")
                .find(|r| r.contains("pip install") && r.contains("mlx-cuda-13=="))
                .map(|r| (s, r))
        })
        .expect("a stage pip-installs mlx-cuda-13");
    let (stage, run) = pip;
    assert!(
        run.contains(&format!("mlx-cuda-13=={version} ")) || run.ends_with(&format!("=={version}")),
        "{rel}: mlx-cuda-13 at MLX {version}: {run}"
    );
    let dir = check_libmlx(rel, &runtime, stage.name.as_deref().expect("a named stage"));
    assert!(
        run.contains(&format!("--target {dir} ")),
        "{rel}: pip installs into {dir}"
    );
    assert_eq!(runtime.env("WEFT_OPENBLAS").as_deref(), Some("0"));
}

#[test]
fn the_build_context_leaves_out_local_builds() {
    let ignore = read(".dockerignore");
    let lines: BTreeSet<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    for p in ["target", ".venv", ".git"] {
        assert!(lines.contains(p), ".dockerignore lacks {p}");
    }
    for needed in ["Cargo.toml", "Cargo.lock", "crates", "proto"] {
        assert!(
            !lines
                .iter()
                .any(|l| needed.starts_with(l.trim_end_matches('/'))),
            ".dockerignore drops {needed}"
        );
    }
}
