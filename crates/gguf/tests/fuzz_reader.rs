//! Property-based fuzzing of the GGUF reader and the converter behind it
//! (issue 17, item 5; cargo-fuzz needs nightly, these run on stable in CI).
//!
//! Inputs are mutations of a small but complete llama GGUF the test builds
//! itself: truncations, random byte overwrites, 8-byte overwrites with
//! hostile values (counts, string lengths, dimensions, offsets) and 4-byte
//! overwrites with type codes. Every case must give `Ok` or a typed
//! `GgufError` — never a panic — and the parse (plus, when it parses, the
//! hyper-parameters, the tensor conversion and the tokenizer build) must not
//! allocate more than a bound derived from the file's size. A counting global
//! allocator measures the peak per thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use proptest::prelude::*;
use weft_gguf::gemma3::{convert_gemma3_weights, Gemma3Params};
use weft_gguf::quant::dequantize_gguf;
use weft_gguf::{
    build_tokenizer, convert_weights, GgmlType, GgufBuilder, GgufError, GgufFile, GgufValue,
    LlamaParams,
};

// ---- per-thread peak allocation --------------------------------------------

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn on_alloc(size: usize) {
    let _ = LIVE.try_with(|l| {
        let now = l.get().saturating_add(size);
        l.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
    let _ = LARGEST.try_with(|m| m.set(m.get().max(size)));
}

fn on_free(size: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub(size)));
}

// SAFETY: forwards to the system allocator; only bookkeeping is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        on_alloc(layout.size());
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        on_free(layout.size());
        System.dealloc(ptr, layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        on_alloc(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        on_free(layout.size());
        on_alloc(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the peak bytes it had live at once
/// (on this thread, above what was live when it started) and its largest
/// single allocation.
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    LARGEST.with(|m| m.set(0));
    let out = f();
    let peak = PEAK.with(Cell::get).saturating_sub(base);
    (out, peak, LARGEST.with(Cell::get))
}

// ---- the seed file -----------------------------------------------------------

/// A complete llama GGUF, as small as the converter accepts: hidden 64,
/// 1 layer, 2 heads of 32, 1 KV head, FFN 32, vocab 8; tensors in every
/// type the converter maps (F32, F16, Q8_0, Q4_0, Q4_1).
fn seed() -> Vec<u8> {
    let s = |v: &str| GgufValue::String(v.into());
    let toks = ["<|end|>", "a", "b", "ab", "c", "Ġ", "Ġa", "d"];
    let mut b = GgufBuilder::new()
        .kv("general.architecture", s("llama"))
        .kv("llama.embedding_length", GgufValue::U32(64))
        .kv("llama.block_count", GgufValue::U32(1))
        .kv("llama.feed_forward_length", GgufValue::U32(32))
        .kv("llama.attention.head_count", GgufValue::U32(2))
        .kv("llama.attention.head_count_kv", GgufValue::U32(1))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-6),
        )
        .kv("llama.rope.freq_base", GgufValue::F32(10000.0))
        .kv("llama.context_length", GgufValue::U32(128))
        .kv("tokenizer.ggml.model", s("gpt2"))
        .kv("tokenizer.ggml.pre", s("smollm"))
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(toks.iter().map(|t| s(t)).collect()),
        )
        .kv(
            "tokenizer.ggml.token_type",
            GgufValue::Array(
                [3, 1, 1, 1, 1, 1, 1, 1]
                    .into_iter()
                    .map(GgufValue::I32)
                    .collect(),
            ),
        )
        .kv(
            "tokenizer.ggml.merges",
            GgufValue::Array(vec![s("a b"), s("Ġ a")]),
        )
        .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(0))
        .kv(
            "some.nested",
            GgufValue::Array(vec![
                GgufValue::Array(vec![GgufValue::U8(1), GgufValue::U8(2)]),
                GgufValue::Array(vec![]),
            ]),
        )
        .kv("some.flag", GgufValue::Bool(true))
        .kv("some.wide", GgufValue::U64(1 << 40));
    let bytes_for = |ty: GgmlType, n: u64| -> Vec<u8> {
        let (be, bb) = ty.block_layout().expect("known layout");
        let len = (n / be * bb) as usize;
        let mut v: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
        if [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0].contains(&ty) {
            for blk in v.chunks_exact_mut(bb as usize) {
                // f16 scale 1/16 (and min, for Q4_1, whatever follows).
                blk[0] = 0x00;
                blk[1] = 0x2c;
            }
        } else if ty == GgmlType::F16 {
            for h in v.chunks_exact_mut(2) {
                h[1] &= 0x3b;
            }
        } else if ty == GgmlType::F32 {
            for f in v.chunks_exact_mut(4) {
                f.copy_from_slice(&1.0f32.to_le_bytes());
            }
        }
        v
    };
    let tensors: [(&str, &[u64], GgmlType); 11] = [
        ("token_embd.weight", &[64, 8], GgmlType::Q8_0),
        ("output_norm.weight", &[64], GgmlType::F32),
        ("blk.0.attn_norm.weight", &[64], GgmlType::F32),
        ("blk.0.ffn_norm.weight", &[64], GgmlType::F32),
        ("blk.0.attn_q.weight", &[64, 64], GgmlType::Q4_1),
        ("blk.0.attn_k.weight", &[64, 32], GgmlType::Q4_0),
        ("blk.0.attn_v.weight", &[64, 32], GgmlType::Q8_0),
        ("blk.0.attn_output.weight", &[64, 64], GgmlType::F16),
        ("blk.0.ffn_gate.weight", &[64, 32], GgmlType::Q4_1),
        ("blk.0.ffn_up.weight", &[64, 32], GgmlType::F32),
        ("blk.0.ffn_down.weight", &[32, 64], GgmlType::Q4_0),
    ];
    for (name, dims, ty) in tensors {
        b = b.tensor(name, dims, ty, bytes_for(ty, dims.iter().product()));
    }
    b.build()
}

/// A complete Gemma 3 GGUF with every K-quant the converter decodes: hidden
/// 256 (K-quant rows are 256 long), 1 layer, 1 head of 256, FFN 256, a
/// SentencePiece vocabulary of 8; Q6_K, Q4_K, Q5_K, Q2_K, Q5_0, Q5_1, Q8_0,
/// F16 and F32 tensors.
fn gemma3_seed() -> Vec<u8> {
    let s = |v: &str| GgufValue::String(v.into());
    let toks = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "\u{2581}",
        "a",
        "\u{2581}a",
        "  ",
    ];
    let mut b = GgufBuilder::new()
        .kv("general.architecture", s("gemma3"))
        .kv("gemma3.embedding_length", GgufValue::U32(256))
        .kv("gemma3.block_count", GgufValue::U32(1))
        .kv("gemma3.feed_forward_length", GgufValue::U32(256))
        .kv("gemma3.attention.head_count", GgufValue::U32(1))
        .kv("gemma3.attention.head_count_kv", GgufValue::U32(1))
        .kv("gemma3.attention.key_length", GgufValue::U32(256))
        .kv("gemma3.attention.value_length", GgufValue::U32(256))
        .kv(
            "gemma3.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-6),
        )
        .kv("gemma3.rope.freq_base", GgufValue::F32(1e6))
        .kv("gemma3.attention.sliding_window", GgufValue::U32(512))
        .kv("gemma3.context_length", GgufValue::U32(1024))
        .kv("tokenizer.ggml.model", s("llama"))
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(toks.iter().map(|t| s(t)).collect()),
        )
        .kv(
            "tokenizer.ggml.scores",
            GgufValue::Array(
                [0.0f32, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, 0.0]
                    .into_iter()
                    .map(GgufValue::F32)
                    .collect(),
            ),
        )
        .kv(
            "tokenizer.ggml.token_type",
            GgufValue::Array(
                [3, 3, 3, 2, 1, 1, 1, 4]
                    .into_iter()
                    .map(GgufValue::I32)
                    .collect(),
            ),
        )
        .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(2))
        .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(1))
        .kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(3))
        .kv("tokenizer.ggml.add_space_prefix", GgufValue::Bool(false));
    let bytes_for = |ty: GgmlType, n: u64| -> Vec<u8> {
        let (be, bb) = ty.block_layout().expect("known layout");
        let len = (n / be * bb) as usize;
        let mut v: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
        if ty == GgmlType::F32 {
            for f in v.chunks_exact_mut(4) {
                f.copy_from_slice(&1.5f32.to_le_bytes());
            }
        }
        v
    };
    let tensors: [(&str, &[u64], GgmlType); 15] = [
        ("token_embd.weight", &[256, 8], GgmlType::Q6_K),
        ("output_norm.weight", &[256], GgmlType::F32),
        ("blk.0.attn_norm.weight", &[256], GgmlType::F32),
        ("blk.0.post_attention_norm.weight", &[256], GgmlType::F16),
        ("blk.0.ffn_norm.weight", &[256], GgmlType::F32),
        ("blk.0.post_ffw_norm.weight", &[256], GgmlType::F32),
        ("blk.0.attn_q_norm.weight", &[256], GgmlType::F32),
        ("blk.0.attn_k_norm.weight", &[256], GgmlType::F32),
        ("blk.0.attn_q.weight", &[256, 256], GgmlType::Q4_K),
        ("blk.0.attn_k.weight", &[256, 256], GgmlType::Q5_K),
        ("blk.0.attn_v.weight", &[256, 256], GgmlType::Q8_0),
        ("blk.0.attn_output.weight", &[256, 256], GgmlType::Q2_K),
        ("blk.0.ffn_gate.weight", &[256, 256], GgmlType::Q5_0),
        ("blk.0.ffn_up.weight", &[256, 256], GgmlType::Q5_1),
        ("blk.0.ffn_down.weight", &[256, 256], GgmlType::Q6_K),
    ];
    for (name, dims, ty) in tensors {
        b = b.tensor(name, dims, ty, bytes_for(ty, dims.iter().product()));
    }
    b.build()
}

/// Where the header ends (the data section starts) in the seed.
fn header_len(bytes: &[u8]) -> usize {
    GgufFile::from_bytes("seed", bytes.to_vec())
        .expect("the seed parses")
        .data_offset() as usize
}

/// Everything a server start does with a GGUF it did not write: parse it,
/// read the hyper-parameters, convert every tensor, build the tokenizer.
/// Returns the parse's outcome (the later steps may fail with typed errors).
fn exercise(bytes: Vec<u8>) -> Result<(), GgufError> {
    let g = GgufFile::from_bytes("fuzz.gguf", bytes)?;
    for t in g.tensors() {
        let _ = g.tensor_data(t);
    }
    for (k, _) in g.metadata() {
        let _ = g.get_u64(k);
        let _ = g.get_str_array(k);
        let _ = g.get_int_array(k);
    }
    if let Ok(p) = LlamaParams::from_gguf(&g) {
        let _ = convert_weights(&g, &p);
    }
    if let Ok(p) = Gemma3Params::from_gguf(&g) {
        let _ = convert_gemma3_weights(&g, &p);
    }
    let _ = build_tokenizer(&g);
    Ok(())
}

/// The allocation bound: a constant factor of the file (metadata values are
/// 32-byte enums, an `ARRAY[UINT8]` element is 1 byte in the file; dequantized
/// or re-laid-out tensors are at most ~8x their packed bytes) plus slack for
/// the tokenizer and error messages.
fn bound(file_len: usize) -> usize {
    64 * file_len + (4 << 20)
}

fn check(bytes: Vec<u8>) -> Result<Result<(), GgufError>, TestCaseError> {
    let len = bytes.len();
    let (out, peak, largest) = measured(|| exercise(bytes));
    prop_assert!(
        peak <= bound(len),
        "peak allocation {peak} bytes for a {len}-byte file (largest single {largest})"
    );
    Ok(out)
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite one byte.
    Byte(usize, u8),
    /// Overwrite 8 bytes (a count, length, dimension or offset) with a value.
    Word(usize, u64),
    /// Overwrite 4 bytes (a type code, a dimension count) with a value.
    Code(usize, u32),
}

fn hostile_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(1 << 32),
        Just(1 << 40),
        Just(u32::MAX as u64),
        0u64..4096,
        any::<u64>(),
    ]
}

fn mutation(len: usize, header: usize) -> impl Strategy<Value = Mutation> {
    // Most of the structure lives in the header: aim three out of four there.
    let pos = prop_oneof![3 => 0..header, 1 => 0..len];
    (
        pos,
        any::<u8>(),
        hostile_u64(),
        0u32..40,
        any::<u32>(),
        0u8..3,
    )
        .prop_map(move |(p, b, w, code, raw, kind)| match kind {
            0 => Mutation::Byte(p, b),
            1 => Mutation::Word(p.min(len - 8), w),
            _ => Mutation::Code(p.min(len - 4), if raw % 4 == 0 { raw } else { code }),
        })
}

fn apply(bytes: &mut [u8], m: &Mutation) {
    match *m {
        Mutation::Byte(p, b) => bytes[p] = b,
        Mutation::Word(p, w) => bytes[p..p + 8].copy_from_slice(&w.to_le_bytes()),
        Mutation::Code(p, c) => bytes[p..p + 4].copy_from_slice(&c.to_le_bytes()),
    }
}

#[test]
fn the_seed_is_valid_and_converts() {
    let bytes = seed();
    let g = GgufFile::from_bytes("seed", bytes.clone()).expect("parse");
    let p = LlamaParams::from_gguf(&g).expect("params");
    let w = convert_weights(&g, &p).expect("convert");
    assert!(w.tensors.len() > 11, "{} tensors", w.tensors.len());
    build_tokenizer(&g).expect("tokenizer");
    // The measuring itself works: a full conversion is seen allocating.
    let (out, peak, _) = measured(|| exercise(bytes.clone()));
    out.expect("seed exercises");
    assert!(peak > bytes.len(), "peak {peak} for {} bytes", bytes.len());
}

#[test]
fn the_gemma3_seed_is_valid_and_converts() {
    let bytes = gemma3_seed();
    let g = GgufFile::from_bytes("seed", bytes.clone()).expect("parse");
    let p = Gemma3Params::from_gguf(&g).expect("params");
    let w = convert_gemma3_weights(&g, &p).expect("convert");
    assert_eq!(w.tensors.len(), 15);
    build_tokenizer(&g).expect("tokenizer");
    let (out, peak, _) = measured(|| exercise(bytes.clone()));
    out.expect("seed exercises");
    assert!(peak > bytes.len(), "peak {peak} for {} bytes", bytes.len());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The Gemma 3 seed (SentencePiece tokenizer, K-quants, bf16 conversion)
    /// under the same hostile overwrites.
    #[test]
    fn mutated_gemma3_files_never_panic_nor_overallocate(
        muts in {
            let b = gemma3_seed();
            let (len, header) = (b.len(), header_len(&b));
            proptest::collection::vec(mutation(len, header), 1..4)
        }
    ) {
        let mut bytes = gemma3_seed();
        for m in &muts {
            apply(&mut bytes, m);
        }
        let _ = check(bytes)?;
    }

    /// Any type code, byte string and element count: values or a typed
    /// error naming the tensor, no panic, no allocation beyond the data's own
    /// decoded size.
    #[test]
    fn dequantize_takes_any_bytes(
        code in 0u32..40,
        data in proptest::collection::vec(any::<u8>(), 0..2048),
        n in prop_oneof![0usize..4096, Just(usize::MAX), Just(usize::MAX / 4)],
    ) {
        let len = data.len();
        let (out, peak, _) = measured(|| dequantize_gguf("t", GgmlType(code), &data, n));
        prop_assert!(peak <= 64 * len + 4096, "peak {peak} for {len} bytes");
        match out {
            Ok(v) => prop_assert_eq!(v.len(), n),
            Err(e) => prop_assert!(e.to_string().contains("\"t\""), "{e}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Every proper prefix of a valid file is an error (the header or a
    /// tensor's data is cut), never `Ok`, never a panic.
    #[test]
    fn truncated_files_are_errors(cut_frac in 0.0f64..1.0) {
        let bytes = seed();
        let cut = ((bytes.len() as f64) * cut_frac) as usize;
        let out = check(bytes[..cut].to_vec())?;
        prop_assert!(out.is_err(), "a file cut at {cut} of {} parsed", bytes.len());
    }

    /// A few hostile overwrites of a valid file: `Ok` or a typed error, no
    /// panic, allocation bounded by the file size.
    #[test]
    fn mutated_files_never_panic_nor_overallocate(
        muts in {
            let b = seed();
            let (len, header) = (b.len(), header_len(&b));
            proptest::collection::vec(mutation(len, header), 1..4)
        }
    ) {
        let mut bytes = seed();
        for m in &muts {
            apply(&mut bytes, m);
        }
        let _ = check(bytes)?;
    }

    /// Random bytes behind a valid magic and version: typed errors only.
    #[test]
    fn random_headers_are_rejected_cleanly(
        version in prop_oneof![Just(2u32), Just(3u32), any::<u32>()],
        body in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&body);
        let out = check(bytes)?;
        if version != 2 && version != 3 {
            prop_assert!(
                matches!(out, Err(GgufError::UnsupportedVersion { .. })),
                "{out:?}"
            );
        }
    }
}

/// Hand-built hostile headers, each refused with the right error kind.
#[test]
fn hostile_counts_and_lengths_are_typed_errors() {
    let head = |tensors: u64, kvs: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&tensors.to_le_bytes());
        b.extend_from_slice(&kvs.to_le_bytes());
        b
    };
    let truncated = |b: Vec<u8>| {
        let r = check(b).expect("bounded");
        assert!(matches!(r, Err(GgufError::Truncated { .. })), "{r:?}");
    };
    truncated(head(0, u64::MAX));
    truncated(head(u64::MAX, 0));
    truncated(head(1 << 40, 1 << 40));
    // A key whose length runs past the end.
    let mut b = head(0, 1);
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    b.extend_from_slice(&[0; 16]);
    truncated(b);
    // A string value whose length runs past the end.
    let mut b = head(0, 1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(b'k');
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&(1u64 << 33).to_le_bytes());
    b.extend_from_slice(&[b'x'; 12]);
    truncated(b);
    // An unknown value type.
    let mut b = head(0, 1);
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(b'k');
    b.extend_from_slice(&13u32.to_le_bytes());
    b.extend_from_slice(&[0; 16]);
    let r = check(b).expect("bounded");
    assert!(
        matches!(r, Err(GgufError::UnknownValueType { .. })),
        "{r:?}"
    );
    // A tensor whose data offset lies past the end of the file.
    let g = GgufBuilder::new()
        .tensor("t", &[4], GgmlType::F32, vec![0; 16])
        .build();
    let mut bad = g.clone();
    // The offset field: after the fixed header (24), the name (8 + 1),
    // n_dims (4), the one dimension (8) and the type (4).
    let start = 4 + 4 + 8 + 8;
    let off = start + 8 + 1 + 4 + 8 + 4;
    bad[off..off + 8].copy_from_slice(&(1u64 << 20).to_le_bytes());
    let r = check(bad).expect("bounded");
    assert!(matches!(r, Err(GgufError::Truncated { .. })), "{r:?}");
    // The seed with block_count raised: the converter must not build
    // billions of tensor names before finding one missing.
    let s = seed();
    let key = b"llama.block_count";
    let at = s
        .windows(key.len())
        .position(|w| w == key)
        .expect("key present")
        + key.len()
        + 4;
    let mut big = s.clone();
    big[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let g = GgufFile::from_bytes("big", big).expect("header is fine");
    let p = LlamaParams::from_gguf(&g).expect("the parameters alone are plausible");
    let (r, peak, _) = measured(|| convert_weights(&g, &p).map(|_| ()));
    assert!(
        matches!(&r, Err(GgufError::MissingTensor { name }) if name.starts_with("blk.1.")),
        "{r:?}"
    );
    assert!(peak <= bound(s.len()), "peak {peak}");
}
