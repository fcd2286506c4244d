//! LoRA adapters against mlx-lm with the adapter loaded (`load_adapters`):
//! a batch mixing four adapters (different ranks, scales, projections and
//! layers) and rows without one, rows joining and leaving, gives every row
//! the logits its adapter gives alone, over dense and quantized bases, on
//! MLX's matmuls, the packed CPU GEMM and compiled decode steps; PEFT's
//! layout loads to the same weights as mlx-lm's; mismatched adapters are
//! refused naming the tensor.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use mlx_rs::Dtype;
use weft_models::{
    Adapter, AdapterFormat, AdapterId, AdapterPoolConfig, BatchRunner, Kernels, LlamaModel,
    ModelConfig, RowStep, StackLayout, Target, WeightPolicy,
};

/// Both sides run f32; differences are summation-order noise (the adapters
/// move logits by O(1), so a wrong or missing adapter is far outside it).
/// On a GPU both sides' f32 matmuls may run as TF32 (10-bit mantissas),
/// which moves log-probs by a few 1e-3: measured 2.5e-3 on the H200.
fn tol() -> f32 {
    match weft_models::Device::detect() {
        weft_models::Device::Gpu => 1e-2,
        weft_models::Device::Cpu => 2e-3,
    }
}

/// The four adapters: (seed, rank, scale, keys, num_layers).
const ADAPTERS: [(u32, usize, f32, &str, i32); 4] = [
    (1, 8, 2.0, "self_attn.q_proj,self_attn.v_proj", 0),
    (2, 16, 1.0, "", 0),
    (3, 4, 1.5, "self_attn.o_proj,mlp.down_proj", 1),
    (4, 2, 4.0, "mlp.gate_proj,mlp.up_proj,self_attn.k_proj", 0),
];

struct Fixture {
    dir: tempfile::TempDir,
    model: PathBuf,
    /// mlx-lm layout, adapter `i` at index `i`.
    adapters: Vec<PathBuf>,
}

impl Fixture {
    fn new(quantize: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m");
        let md = model.to_str().unwrap();
        let mut args = vec!["fixture", "--arch", "llama-tiny", "--out", md];
        if quantize {
            args.push("--quantize");
        }
        oracle(&args);
        let mut adapters = Vec::new();
        for (i, (seed, rank, scale, keys, layers)) in ADAPTERS.iter().enumerate() {
            let out = dir.path().join(format!("a{i}"));
            let peft = dir.path().join(format!("p{i}"));
            let (seed, rank, scale, layers) = (
                seed.to_string(),
                rank.to_string(),
                scale.to_string(),
                layers.to_string(),
            );
            let mut args = vec![
                "lora-fixture",
                "--model",
                md,
                "--out",
                out.to_str().unwrap(),
                "--rank",
                &rank,
                "--scale",
                &scale,
                "--seed",
                &seed,
                "--num-layers",
                &layers,
                "--peft-out",
                peft.to_str().unwrap(),
            ];
            if !keys.is_empty() {
                args.extend(["--keys", keys]);
            }
            oracle(&args);
            adapters.push(out);
        }
        Self {
            dir,
            model,
            adapters,
        }
    }

    fn config(&self) -> ModelConfig {
        ModelConfig::load(&self.model).unwrap()
    }

    fn load(&self, policy: WeightPolicy) -> LlamaModel {
        let weights = weft_models::weights::Weights::load_dir(&self.model).unwrap();
        LlamaModel::from_weights(self.config(), weights, policy).unwrap()
    }

    /// A runner with every adapter resident, adapter `i` as id `i + 1`.
    fn runner(&self, policy: WeightPolicy) -> BatchRunner {
        self.runner_laid_out(policy, StackLayout::Auto)
    }

    /// [`runner`](Self::runner) with the pool's `A` stacks in `layout`.
    fn runner_laid_out(&self, policy: WeightPolicy, layout: StackLayout) -> BatchRunner {
        let mut r = runner(self.load(policy), 64);
        r.set_adapter_pool(Some(AdapterPoolConfig {
            layout,
            ..AdapterPoolConfig::new(4, 16)
        }))
        .unwrap();
        for (i, p) in self.adapters.iter().enumerate() {
            let a = Adapter::load(p, &self.config()).unwrap();
            r.load_adapter(AdapterId(i as u64 + 1), &a).unwrap();
        }
        r
    }

    /// mlx-lm's greedy continuation of each of `rows` with `adapter`
    /// (index into the fixture's, or None), one log-prob vector per token.
    fn oracle(&self, adapter: Option<usize>, rows: &[&Row]) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
        if rows.is_empty() {
            return Vec::new();
        }
        let n = rows.iter().map(|r| r.max_tokens).max().unwrap();
        let prompts: Vec<_> = rows
            .iter()
            .map(|r| serde_json::json!({"ids": r.ids}))
            .collect();
        let req = self
            .dir
            .path()
            .join(format!("req-{}.json", adapter.map_or(0, |a| a + 1)));
        std::fs::write(
            &req,
            serde_json::json!({"max_tokens": n, "full": true, "prompts": prompts}).to_string(),
        )
        .unwrap();
        let mut args = vec![
            "run",
            "--model",
            self.model.to_str().unwrap(),
            "--requests",
            req.to_str().unwrap(),
        ];
        let path;
        if let Some(a) = adapter {
            path = self.adapters[a].to_str().unwrap().to_string();
            args.extend(["--adapter", path.as_str()]);
        }
        let want = oracle(&args);
        rows.iter()
            .enumerate()
            .map(|(i, r)| {
                let w = &want["results"][i];
                let tokens = json_u32(&w["greedy"])[..r.max_tokens].to_vec();
                let steps = w["steps"].as_array().unwrap()[..r.max_tokens]
                    .iter()
                    .map(json_f32)
                    .collect();
                (tokens, steps)
            })
            .collect()
    }
}

/// Eight rows joining at different steps and leaving at different lengths.
fn rows() -> Vec<Row> {
    let p = |n: usize, k: u32| (0..n as u32).map(|i| (i * 37 + k * 11) % 256).collect();
    [
        (5, 0, 7),
        (1, 0, 9),
        (17, 1, 6),
        (9, 2, 8),
        (3, 2, 5),
        (24, 4, 7),
        (6, 6, 4),
        (12, 7, 6),
    ]
    .iter()
    .enumerate()
    .map(|(k, &(len, join, n))| Row {
        ids: p(len, k as u32),
        max_tokens: n,
        join_step: join,
    })
    .collect()
}

/// Row `i`'s adapter: each of the four twice-or-so, and none.
fn assignment() -> Vec<Option<AdapterId>> {
    [
        Some(1),
        None,
        Some(2),
        Some(3),
        Some(4),
        Some(1),
        None,
        Some(2),
    ]
    .iter()
    .map(|a| a.map(AdapterId))
    .collect()
}

/// The oracle's continuation of every row under `assign`.
fn expected(f: &Fixture, rows: &[Row], assign: &[Option<AdapterId>]) -> Trace {
    let mut out: Trace = rows.iter().map(|_| (vec![], vec![])).collect();
    for adapter in [None, Some(0), Some(1), Some(2), Some(3)] {
        let id = adapter.map(|a: usize| AdapterId(a as u64 + 1));
        let mine: Vec<usize> = (0..rows.len()).filter(|&i| assign[i] == id).collect();
        let got = f.oracle(adapter, &mine.iter().map(|&i| &rows[i]).collect::<Vec<_>>());
        for (i, g) in mine.into_iter().zip(got) {
            out[i] = g;
        }
    }
    out
}

/// Largest |difference| of row `i`'s log-probs over its steps.
fn row_diff(a: &Trace, b: &Trace, i: usize) -> f32 {
    a[i].1
        .iter()
        .zip(&b[i].1)
        .map(|(x, y)| max_abs_diff(x, y))
        .fold(0.0, f32::max)
}

fn assert_matches(label: &str, got: &Trace, want: &Trace) {
    for i in 0..want.len() {
        let d = row_diff(got, want, i);
        eprintln!("{label} row {i}: max |dlogprob| {d:.2e}");
        assert!(
            d < tol(),
            "{label} row {i}: log-probs differ by {d} (tolerance {})",
            tol()
        );
        assert_eq!(got[i].0, want[i].0, "{label} row {i}: greedy tokens differ");
    }
}

const DENSE_F32: WeightPolicy = WeightPolicy {
    dequantize: true,
    dtype: Dtype::Float32,
    kernels: Kernels::Stock,
    host_gemm: false,
};

#[test]
fn a_batch_mixing_four_adapters_and_none_matches_each_alone() {
    let f = Fixture::new(false);
    let rs = rows();
    let assign = assignment();
    let want = expected(&f, &rs, &assign);
    // Both stack layouts: every slot's shrink masked to the row's, and
    // gathered matmuls.
    let mut g = f.runner_laid_out(DENSE_F32, StackLayout::Gathered);
    let got = drive_adapters(&mut g, &rs, &assign, |_| false, |_, _| {});
    assert_matches("gathered", &got, &want);
    let mut r = f.runner_laid_out(DENSE_F32, StackLayout::Dense);
    let got = drive_adapters(&mut r, &rs, &assign, |_| false, |_, _| {});
    assert_matches("dense", &got, &want);

    // The test can fail: rows given each other's adapters (1 <-> 2, 3 <->
    // 4, none -> 1) are far outside the tolerance, every one of them.
    let swapped: Vec<Option<AdapterId>> = assign
        .iter()
        .map(|a| match a.map(|x| x.0) {
            None => Some(AdapterId(1)),
            Some(1) => Some(AdapterId(2)),
            Some(2) => Some(AdapterId(1)),
            Some(3) => Some(AdapterId(4)),
            _ => Some(AdapterId(3)),
        })
        .collect();
    let wrong = drive_adapters(&mut r, &rs, &swapped, |_| false, |_, _| {});
    for i in 0..rs.len() {
        let d = row_diff(&wrong, &want, i);
        assert!(
            d > 50.0 * tol(),
            "row {i}: another adapter moves its log-probs by only {d}"
        );
    }
}

#[test]
fn mixed_adapters_on_the_cpu_default_kernels_and_packed_gemm_match_mlx_lm() {
    let f = Fixture::new(false);
    let rs = rows();
    let assign = assignment();
    let want = expected(&f, &rs, &assign);
    let mut r = f.runner(WeightPolicy {
        kernels: Kernels::CpuTuned,
        host_gemm: true,
        ..DENSE_F32
    });
    let got = drive_adapters(&mut r, &rs, &assign, |_| false, |_, _| {});
    assert_matches("packed", &got, &want);
}

/// mlx-lm's LoRA over its quantized linears; Weft keeps the base quantized
/// (MLX's quantized matmul below 8 rows, dequantized above) and adds the
/// same deltas.
#[test]
fn mixed_adapters_over_a_quantized_base_match_mlx_lm() {
    let f = Fixture::new(true);
    let rs = rows();
    let assign = assignment();
    let want = expected(&f, &rs, &assign);
    let mut r = f.runner(WeightPolicy {
        dequantize: false,
        ..DENSE_F32
    });
    let got = drive_adapters(&mut r, &rs, &assign, |_| false, |_, _| {});
    assert_matches("quantized", &got, &want);
}

/// Compiled decode steps take the adapters' arrays and slots as inputs: the
/// same results as op by op, and an adapter swapped into a slot after the
/// traces were made is what the next steps run (no retrace, no stale
/// constant).
#[test]
fn compiled_decode_steps_take_adapters_as_inputs() {
    let f = Fixture::new(false);
    let rs = rows();
    let assign = assignment();
    let want = expected(&f, &rs, &assign);
    let mut r = f.runner(DENSE_F32);
    r.set_compiled_decode(true).unwrap();
    let got = drive_adapters(&mut r, &rs, &assign, |_| false, |_, _| {});
    assert_matches("compiled", &got, &want);
    let traces = r.compiled_decode().unwrap().traces();
    assert!(traces > 0, "no decode step ran compiled");

    // Id 1 now names adapter 2's weights and id 2 adapter 1's: the same
    // schedule meets the same buckets, so nothing retraces, and each row
    // gets the swapped adapter's logits.
    let cfg = f.config();
    for id in [1, 2] {
        assert!(r.unload_adapter(AdapterId(id)).unwrap());
    }
    r.load_adapter(AdapterId(1), &Adapter::load(&f.adapters[1], &cfg).unwrap())
        .unwrap();
    r.load_adapter(AdapterId(2), &Adapter::load(&f.adapters[0], &cfg).unwrap())
        .unwrap();
    let swapped: Vec<Option<AdapterId>> = assign
        .iter()
        .map(|a| match a.map(|x| x.0) {
            Some(1) => Some(AdapterId(2)),
            Some(2) => Some(AdapterId(1)),
            other => other.map(AdapterId),
        })
        .collect();
    let again = drive_adapters(&mut r, &rs, &swapped, |_| false, |_, _| {});
    assert_matches("compiled, adapters moved between slots", &again, &want);
    assert_eq!(
        r.compiled_decode().unwrap().traces(),
        traces,
        "swapping adapters retraced the compiled decode step"
    );
}

/// Faults mid-forward and after evaluation roll back and retry to the same
/// tokens and log-probs, with adapters in the batch.
#[test]
fn failed_steps_with_adapters_roll_back_to_the_same_tokens() {
    let f = Fixture::new(false);
    let rs = rows();
    let assign = assignment();
    faults_at_roll_back(&rs, &assign, &[0, 2, 4, 7], || f.runner(DENSE_F32));
}

#[test]
fn peft_layout_loads_the_same_weights_as_mlx_lm_layout() {
    let f = Fixture::new(false);
    let cfg = f.config();
    for i in 0..ADAPTERS.len() {
        let mlx = Adapter::load(&f.adapters[i], &cfg).unwrap();
        let peft = Adapter::load(&f.dir.path().join(format!("p{i}")), &cfg).unwrap();
        assert_eq!(mlx.format, AdapterFormat::MlxLm);
        assert_eq!(peft.format, AdapterFormat::Peft);
        assert_eq!(mlx.rank, peft.rank);
        assert!((mlx.scale - peft.scale).abs() < 1e-6, "adapter {i}: scales");
        assert_eq!(mlx.targets(), peft.targets());
        for (l, (a, b)) in mlx.layers.iter().zip(&peft.layers).enumerate() {
            assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
            for (t, pa) in a {
                let pb = &b[t];
                assert_eq!(
                    to_vec_f32(&pa.a),
                    to_vec_f32(&pb.a),
                    "{i} layer {l} {t:?} A"
                );
                assert_eq!(
                    to_vec_f32(&pa.b),
                    to_vec_f32(&pb.b),
                    "{i} layer {l} {t:?} B"
                );
            }
        }
    }
    // rsLoRA: alpha / sqrt(r).
    let dir = f.dir.path().join("rs");
    let md = f.model.to_str().unwrap();
    let (a, p) = (dir.join("a"), dir.join("p"));
    oracle(&[
        "lora-fixture",
        "--model",
        md,
        "--out",
        a.to_str().unwrap(),
        "--rank",
        "16",
        "--scale",
        "0.75",
        "--seed",
        "9",
        "--peft-out",
        p.to_str().unwrap(),
        "--rslora",
    ]);
    let peft = Adapter::load(&p, &cfg).unwrap();
    assert!(
        (peft.scale - 0.75).abs() < 1e-6,
        "rslora scale {}",
        peft.scale
    );

    // Through the runner: a row with the PEFT adapter gets exactly the
    // logits of the same row with the mlx-lm one.
    let mut r = f.runner(DENSE_F32);
    r.unload_adapter(AdapterId(4)).unwrap();
    let peft0 = Adapter::load(&f.dir.path().join("p0"), &cfg).unwrap();
    r.load_adapter(AdapterId(9), &peft0).unwrap();
    let rs: Vec<Row> = rows().into_iter().take(2).collect();
    let both = [Some(AdapterId(1)), Some(AdapterId(9))];
    let rs2 = vec![
        Row {
            ids: rs[0].ids.clone(),
            max_tokens: 4,
            join_step: 0,
        },
        Row {
            ids: rs[0].ids.clone(),
            max_tokens: 4,
            join_step: 0,
        },
    ];
    let got = drive_adapters(&mut r, &rs2, &both, |_| false, |_, _| {});
    assert_eq!(
        got[0], got[1],
        "PEFT and mlx-lm layouts of one adapter differ"
    );
}

/// Writes an mlx-lm adapter of `tensors` (name, shape) with `config`.
fn write_adapter(dir: &Path, config: serde_json::Value, tensors: &[(&str, Vec<usize>)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, s)| {
            let len: usize = s.iter().product();
            let bytes = (0..len)
                .flat_map(|i| (i as f32 * 0.01).to_le_bytes())
                .collect();
            (n.to_string(), bytes, s.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, b, s)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("adapters.safetensors")).unwrap();
}

fn mlx_config(rank: usize) -> serde_json::Value {
    serde_json::json!({"fine_tune_type": "lora", "num_layers": 2,
        "lora_parameters": {"rank": rank, "scale": 1.0, "dropout": 0.0}})
}

fn load_err(dir: &Path, cfg: &ModelConfig) -> String {
    match Adapter::load(dir, cfg) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// A broken adapter: what is wrong, its config, its tensors (name, shape)
/// and what the error must say.
type Case = (
    &'static str,
    serde_json::Value,
    Vec<(String, Vec<usize>)>,
    Vec<&'static str>,
);

#[test]
fn mismatched_adapters_are_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny");
    let big = dir.path().join("big");
    oracle(&[
        "fixture",
        "--arch",
        "llama-tiny",
        "--out",
        tiny.to_str().unwrap(),
    ]);
    oracle(&["fixture", "--arch", "llama", "--out", big.to_str().unwrap()]);
    let cfg = ModelConfig::load(&tiny).unwrap();

    // An adapter trained for another model (hidden 128, 3 layers).
    let other = dir.path().join("other");
    oracle(&[
        "lora-fixture",
        "--model",
        big.to_str().unwrap(),
        "--out",
        other.to_str().unwrap(),
        "--rank",
        "8",
        "--scale",
        "1",
        "--seed",
        "1",
        "--num-layers",
        "1",
    ]);
    let e = load_err(&other, &cfg);
    assert!(
        e.contains("model.layers.2.") && e.contains("base model has 2 layers"),
        "{e}"
    );
    let other2 = dir.path().join("other2");
    oracle(&[
        "lora-fixture",
        "--model",
        big.to_str().unwrap(),
        "--out",
        other2.to_str().unwrap(),
        "--rank",
        "8",
        "--scale",
        "1",
        "--seed",
        "1",
        "--keys",
        "self_attn.q_proj",
    ]);
    let e = load_err(&other2, &cfg);
    assert!(
        e.contains("model.layers.0.self_attn.q_proj.lora_a")
            && e.contains("[128, 8]")
            && e.contains("expected [64, 8]"),
        "{e}"
    );

    let q = "model.layers.0.self_attn.q_proj";
    let cases: Vec<Case> = vec![
        (
            "rank",
            mlx_config(4),
            vec![
                (format!("{q}.lora_a"), vec![64, 8]),
                (format!("{q}.lora_b"), vec![8, 64]),
            ],
            vec!["model.layers.0.self_attn.q_proj.lora_a", "expected [64, 4]"],
        ),
        (
            "partner",
            mlx_config(4),
            vec![(format!("{q}.lora_a"), vec![64, 4])],
            vec!["model.layers.0.self_attn.q_proj.lora_a", "lora_b"],
        ),
        (
            "module",
            mlx_config(4),
            vec![(
                "model.layers.0.self_attn.qkv_proj.lora_a".into(),
                vec![64, 4],
            )],
            vec!["model.layers.0.self_attn.qkv_proj.lora_a", "qkv_proj"],
        ),
        (
            "not lora",
            mlx_config(4),
            vec![("model.embed_tokens.weight".into(), vec![4, 4])],
            vec!["model.embed_tokens.weight"],
        ),
        (
            "k out",
            mlx_config(4),
            vec![
                ("model.layers.1.self_attn.k_proj.lora_a".into(), vec![64, 4]),
                ("model.layers.1.self_attn.k_proj.lora_b".into(), vec![4, 64]),
            ],
            vec!["model.layers.1.self_attn.k_proj.lora_b", "expected [4, 32]"],
        ),
        (
            "too big a rank",
            mlx_config(65),
            vec![
                (format!("{q}.lora_a"), vec![64, 65]),
                (format!("{q}.lora_b"), vec![65, 64]),
            ],
            vec!["rank 65"],
        ),
        (
            "dora",
            serde_json::json!({"fine_tune_type": "dora", "num_layers": 2,
                "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0}}),
            vec![
                (format!("{q}.lora_a"), vec![64, 4]),
                (format!("{q}.lora_b"), vec![4, 64]),
            ],
            vec!["dora"],
        ),
        (
            "outside num_layers",
            serde_json::json!({"fine_tune_type": "lora", "num_layers": 1,
                "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0}}),
            vec![
                (format!("{q}.lora_a"), vec![64, 4]),
                (format!("{q}.lora_b"), vec![4, 64]),
            ],
            vec![
                "model.layers.0.self_attn.q_proj.lora_a",
                "outside the layers",
            ],
        ),
        (
            "outside keys",
            serde_json::json!({"fine_tune_type": "lora", "num_layers": 2,
                "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0,
                    "keys": ["self_attn.v_proj"]}}),
            vec![
                (format!("{q}.lora_a"), vec![64, 4]),
                (format!("{q}.lora_b"), vec![4, 64]),
            ],
            vec!["model.layers.0.self_attn.q_proj.lora_a", "does not list"],
        ),
    ];
    for (what, config, tensors, needles) in cases {
        let d = dir.path().join(what.replace(' ', "_"));
        let t: Vec<(&str, Vec<usize>)> = tensors
            .iter()
            .map(|(n, s)| (n.as_str(), s.clone()))
            .collect();
        write_adapter(&d, config, &t);
        let e = load_err(&d, &cfg);
        for n in needles {
            assert!(e.contains(n), "{what}: {e:?} does not say {n:?}");
        }
    }
    // Not a safetensors file at all.
    let d = dir.path().join("garbage");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("adapter_config.json"), mlx_config(4).to_string()).unwrap();
    std::fs::write(
        d.join("adapters.safetensors"),
        b"\xff\xff\xff\xff not a header",
    )
    .unwrap();
    load_err(&d, &cfg);
}

/// The runner refuses rows naming adapters that are not resident, and
/// adapters the pool cannot hold, without opening a step.
#[test]
fn the_runner_refuses_unknown_and_oversized_adapters() {
    let f = Fixture::new(false);
    let cfg = f.config();
    let mut r = runner(f.load(DENSE_F32), 16);
    let big = Adapter::load(&f.adapters[1], &cfg).unwrap(); // rank 16
    assert!(r.load_adapter(AdapterId(1), &big).is_err(), "no pool yet");
    let mut pool = AdapterPoolConfig::new(1, 8);
    pool.targets = [Target::Q, Target::V].into_iter().collect();
    r.set_adapter_pool(Some(pool)).unwrap();
    let e = r.load_adapter(AdapterId(1), &big).unwrap_err().to_string();
    assert!(e.contains("rank 16"), "{e}");
    let qv = Adapter::load(&f.adapters[0], &cfg).unwrap();
    let down = Adapter::load(&f.adapters[2], &cfg).unwrap();
    let e = r.load_adapter(AdapterId(3), &down).unwrap_err().to_string();
    assert!(e.contains("self_attn.o_proj"), "{e}");
    assert_eq!(r.load_adapter(AdapterId(1), &qv).unwrap(), 1);
    assert!(
        r.load_adapter(AdapterId(2), &qv).is_err(),
        "pool of one is full"
    );

    let mut kv = Kv::for_runner(&r);
    let mut steps = vec![RowStep {
        row: 0,
        tokens: vec![1, 2, 3],
        want_logits: true,
        adapter: Some(AdapterId(7)),
        ..Default::default()
    }];
    let ops = kv.plan(&mut steps);
    let e = r.forward(&ops, &steps).unwrap_err().to_string();
    assert!(e.contains("adapter 7"), "{e}");
    kv.rollback();
    steps[0].adapter = Some(AdapterId(1));
    let ops = kv.plan(&mut steps);
    r.forward(&ops, &steps).unwrap();
    r.commit().unwrap();
    kv.commit();
}

/// More adapters registered than the pool holds: each forward makes its
/// rows' adapters resident from their host files, evicting the least
/// recently used; rows get the oracle's logits in every phase — adapters 1
/// and 2, then 3 and 4 (both evicted), then 1 and 2 again (loaded back) —
/// and a forward naming more adapters than slots is refused.
#[test]
fn adapters_beyond_the_slots_load_on_use_and_evict_the_least_recent() {
    let f = Fixture::new(false);
    let mut r = runner(f.load(DENSE_F32), 64);
    // Dense: an evicting load overwrites the victim's blocks in place of
    // the stacks' (the gathered layout's slot writes are covered above).
    r.set_adapter_pool(Some(AdapterPoolConfig {
        layout: StackLayout::Dense,
        ..AdapterPoolConfig::new(2, 16)
    }))
    .unwrap();
    for (i, p) in f.adapters.iter().enumerate() {
        let files = weft_models::AdapterFiles::read(p).unwrap();
        let a = r.register_adapter(AdapterId(i as u64 + 1), files).unwrap();
        assert_eq!(a.rank, ADAPTERS[i].1);
    }
    assert!(
        r.register_adapter(
            AdapterId(1),
            weft_models::AdapterFiles::read(&f.adapters[0]).unwrap()
        )
        .is_err(),
        "an id registered twice"
    );
    let rs = rows();
    let pick = |x: u64, y: u64| -> Vec<Option<AdapterId>> {
        [
            Some(x),
            None,
            Some(y),
            Some(x),
            Some(y),
            Some(x),
            None,
            Some(y),
        ]
        .iter()
        .map(|a| a.map(AdapterId))
        .collect()
    };
    let (first, second) = (pick(1, 2), pick(3, 4));
    let want_first = expected(&f, &rs, &first);
    let want_second = expected(&f, &rs, &second);
    let got = drive_adapters(&mut r, &rs, &first, |_| false, |_, _| {});
    assert_matches("adapters 1 and 2", &got, &want_first);
    assert_eq!(r.adapter_counters().loads, 2);
    assert_eq!(r.adapter_counters().evictions, 0);
    let got = drive_adapters(&mut r, &rs, &second, |_| false, |_, _| {});
    assert_matches("adapters 3 and 4", &got, &want_second);
    assert_eq!(r.adapter_counters().evictions, 2);
    let resident: Vec<u64> = r
        .adapters()
        .unwrap()
        .resident()
        .map(|(_, id)| id.0)
        .collect();
    assert_eq!(resident.len(), 2);
    assert!(resident.contains(&3) && resident.contains(&4));
    let got = drive_adapters(&mut r, &rs, &first, |_| false, |_, _| {});
    assert_matches("adapters 1 and 2 again", &got, &want_first);
    assert_eq!(r.adapter_counters().loads, 6);

    // Three adapters in one forward with two slots: refused, nothing opened.
    let mut kv = Kv::for_runner(&r);
    let mut steps: Vec<RowStep> = (0..3)
        .map(|i| RowStep {
            row: i,
            tokens: vec![1, 2, 3],
            want_logits: true,
            adapter: Some(AdapterId(i + 1)),
            ..Default::default()
        })
        .collect();
    let ops = kv.plan(&mut steps);
    let e = r.forward(&ops, &steps).unwrap_err().to_string();
    assert!(e.contains("3 adapters"), "{e}");
    kv.rollback();
    // Forgotten: its slot and files go; rows may no longer name it.
    assert!(r.forget_adapter(AdapterId(1)).unwrap());
    assert!(r.adapters().unwrap().slot_of(AdapterId(1)).is_none());
    let mut one = vec![RowStep {
        row: 9,
        tokens: vec![1, 2, 3],
        want_logits: true,
        adapter: Some(AdapterId(1)),
        ..Default::default()
    }];
    let ops = kv.plan(&mut one);
    let e = r.forward(&ops, &one).unwrap_err().to_string();
    assert!(e.contains("not registered"), "{e}");
    kv.rollback();
}

/// The memory plan's step bound counts what adapter deltas hold
/// (`AdapterPool::step_elements_per_token`, added to each token's
/// activations): a prefill of rows through an adapter on every projection
/// peaks no further above the same prefill without adapters than that, in
/// both stack layouts.
#[test]
fn the_step_bound_covers_the_adapter_deltas() {
    let f = Fixture::new(false);
    for layout in [StackLayout::Gathered, StackLayout::Dense] {
        let mut r = f.runner_laid_out(DENSE_F32, layout);
        let per_token = r.adapters().unwrap().step_elements_per_token();
        assert!(per_token > 0, "{layout:?}: no adapter term");
        let (rows, len) = (4u64, 32u32);
        let mut peak = |adapter: Option<u64>| -> u64 {
            let mut kv = Kv::for_runner(&r);
            let mut steps: Vec<RowStep> = (0..rows)
                .map(|i| RowStep {
                    row: i,
                    tokens: (1..=len).map(|t| t + i as u32).collect(),
                    want_logits: true,
                    adapter: adapter.map(AdapterId),
                    ..Default::default()
                })
                .collect();
            let ops = kv.plan(&mut steps);
            let before = weft_models::memory::mlx_memory().unwrap().active;
            weft_models::memory::reset_peak().unwrap();
            let out = r.forward(&ops, &steps).unwrap();
            let peak = weft_models::memory::mlx_memory().unwrap().peak;
            drop(out);
            r.rollback();
            kv.rollback();
            peak.saturating_sub(before)
        };
        // Adapter 2 (index 1) adapts every projection at rank 16.
        peak(None);
        let plain = peak(None);
        let adapted = peak(Some(2));
        let bound = rows * u64::from(len) * per_token * 4;
        eprintln!(
            "{layout:?}: step peak {plain} B without adapters, {adapted} B with, bound of the deltas {bound} B"
        );
        assert!(adapted > plain, "{layout:?}: the deltas took no memory?");
        assert!(
            adapted <= plain + bound,
            "{layout:?}: the adapters' step peaked {} B above the plain one, past their bound {bound} B",
            adapted - plain
        );
    }
}
