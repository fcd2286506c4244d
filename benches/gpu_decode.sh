#!/usr/bin/env bash
# Stages the GPU decode runs of issue 14 (device sampling, pipelined and
# compiled decode) for the device machine, under .gpustash/d1 and d2
# (git-ignored): the runner's decode step (graph build vs evaluation wait,
# device vs host sampling) and Weft's engine vs mlx-lm's BatchGenerator on
# the ~1.2B random Llama, bf16 and 4-bit, which the device makes itself
# (benches/make_model.py: mlx-lm's model class and quantizer). MLX's CUDA
# build travels as .gpu/a and .gpu/b (../shared/gpu/prepare.sh staging).
#
#   bash benches/gpu_decode.sh     # here, after `cargo build --release -p weft-grpc -p weft-models --examples --bins`
#   call 1: carry .gpu/a .gpustash/d1    bash .gpu/a/stash.sh && mkdir -p /root/ws && cp .gpustash/d1/* /root/ws/
#   call 2: carry .gpu/b .gpustash/d2    bash .gpu/b/env.sh bash .gpustash/d2/run.sh
#           STEPS=check,kernel,decode,engine,plain,q4,server picks parts; STREAMS=1,8,32,64,128,256;
#           decode: DECODE_ROWS="1 64 128 256"; OPS_SWEEP="40 100" adds pipelined steps at
#           SWEEP_ROWS ("1 64") with MLX_MAX_OPS_PER_BUFFER at each value; SPLIT_SWEEP="32 16"
#           the same with WEFT_SPLIT_KEYS (fewest keys per paged-attention split);
#           SKIP_Q4_ENGINE=1: q4 makes the 4-bit model for the sweeps without its own engine run;
#           q4 with QMM_SWEEP="4 16": the 4-bit engine again with WEFT_QMM_MAX_ROWS at each;
#           plain: the engine with WEFT_PIPELINE=off at PLAIN_STREAMS (1,8,64);
#           nocompile: the engine with WEFT_COMPILE=off at PLAIN_STREAMS;
#           decode: each row count one step at a time, pipelined compiled (fused decode
#           kernels), compiled with WEFT_FUSED=off, and WEFT_COMPILE=off, with graph census;
#           gemvstep: decode_timing with WEFT_GEMV_MAX_ROWS=0 and 8 at GEMV_ROWS_STEP (1 8)
#           (the 4-bit model too with q4),
#           and fused_decode_check with the GEMV kernels (bf16; 4-bit too with q4);
#           gemv: benches/gemv_probe.py (MLX's few-row matmuls vs Weft's GEMV kernels) at GEMV_ROWS
#           and columns per warp GEMV_COLS (1,2,4; WEFT_GEMV_COLS sets the engine's);
#           GEMV_SWEEP="0 8": the engine again with WEFT_GEMV_MAX_ROWS at each value (0 = off);
#           long: weft bench-engine --scenario long-prompts (issue 17 item 1; LONG_TRACE=1 keeps
#           the scheduler's per-step trace in long-trace-BIN.log.gz);
#           WEFT_BINS="weft_base weft" runs long and mix once per binary, an entry
#           bin:ENV=VAL,ENV2=VAL2 with those settings (BASE_WEFT=path at
#           staging stages an older build as weft_base, EXTRA_WEFTS="weft_x=path ..." more:
#           A/B on one machine);
#           mix: weft bench --scenario tenant-mix (MIX_FLOOD streams, MIX_PHASE per phase), once per
#           --isolation-window-ms in MIX_WINDOWS (default "5000 0": the window on, then off);
#           soak: weft bench --scenario soak for SOAK_DURATION (default 300s), one server per
#           SOAK_VARIANTS entry (default; or settings: WEFT_MLX_MEMORY_LIMIT=off);
#           constrained: benches/constrained.sh on the 1.2B model (C_STREAMS, default 32);
#           lora: LoRA throughput (issue 18 item 5) at LORA_STREAMS (default 64), prompt 128, gen 128:
#           weft bench-engine with no adapter and with 8 random rank-16 adapters on all seven
#           projections (rows round-robin; files kept in /root/lora8), mlx-lm BatchGenerator with
#           no adapter and with /root/lora8/adapter-1 on every row (load_adapters: mlx-lm serving
#           one adapter at a time); prints Weft 8 adapters / none (target >= 0.8x) and
#           Weft 8 adapters / mlx-lm one adapter;
#           cache: bench-engine at CACHE_STREAMS (64) with --mlx-cache-limit in CACHE_LIMITS ("40MiB auto
#           off": one decode step's bound, the GPU's auto, MLX's default), no adapters and 8 rank-16
#           adapters each;
#           lorastep: decode_timing (pipelined, compiled, census) at LORA_STREAMS rows with 8 random
#           rank-16 adapters vs none, twice each: the step's host time and primitives (LORASTEP_RUNS,
#           default "0 8 8f 0 8 8f"; 8: WEFT_LORA_SHRINK=matmul, 8f: the fused shrinks but the output
#           projections' (WEFT_LORA_O_SHRINK=matmul), 8p: all fused, the default); PROFILE=n adds decode_timing's sampled host profile (top n; all stacks
#           folded in profile-RUN-ADAPTERS.folded under $OUT), LORASTEP_STEPS its steps (60);
#           lorasweep: Weft alone at LORA_STREAMS, no adapters then 8 under each of LORA_VARIANTS
#           (env settings, a comma between two of one variant; default: as is, MLX_MAX_MB_PER_BUFFER=1000000, WEFT_LORA_LAYOUT=gathered),
#           ~30 s each;
#           LORA_GATHERED=1 adds Weft's 8-adapter run with WEFT_LORA_LAYOUT=gathered;
#           hostprof: perf's flat profile of bench-engine at 64 rows, no adapters and 8 (HP_ENV), when perf exists;
#           adapterpar: crates/models/tests/lora_parity.rs on the GPU (staged when its test binary is built),
#           the tests matching LP_FILTER (default compiled_decode: the fused decode layer's LoRA expand;
#           LP_FILTER= runs all, ~2 min each), the oracle on the CPU;
#           kvq: quantized KV (issue 15 item 3): paged_attention_check with KV_BITS=8 and 4 (the
#           kernel's quantized read vs gather + dequantize + SDPA), then weft bench-engine at
#           KVQ_STREAMS (default 128), prompt 128, gen 128: bf16 KV, --kv-bits 8 and 4 (the paged
#           kernel reads them, the default), and --kv-bits 8 and 4 gathered (WEFT_KV_QUANT_KERNEL=0);
#           hybrid: a random Qwen3.5-0.8B-shaped hybrid (benches/make_model.py --arch qwen3_5,
#           bf16, the default model's vocabulary) made at /root/q35: Weft's engine vs mlx-lm's
#           BatchGenerator at HYBRID_STREAMS (default 1,8,32,64), prompt 128, gen 128 (issue 15
#           item 2: recurrent-state rows on the GPU, decode op by op);
#           firstcall: benches/attention_first_call.py (first call per prefill shape);
#           attnprobe: benches/composed_attention_probe.py (a deep chunk's attention, f32 vs bf16 scores);
#           mixedstep: decode_timing with CHUNK (MIXED_ROWS (8) decoding rows + a long prompt's chunk
#           each step) at MIXED_DEPTHS ("512 5000") x MIXED_CHUNKS ("16 256"): one compiled mixed
#           forward (WEFT_MIXED=on), two forwards (WEFT_MIXED=off), and the chunk op by op
#           (MIXED_VARIANTS overrides that list);
#           mixedpar: crates/models/tests/compiled_prefill.rs on the GPU (staged when its test
#           binary is built; MP_FILTER, default mixed), tolerance WEFT_TEST_TOLERANCE (default 1e-3);
#           check: fused_decode_check (compiled steps vs op-by-op, same KV) at CHECK_ROWS;
#           split64: bench-engine and weft serve at 64 streams, server variants SPLIT_VARIANTS
#           (default, t4 / w16: 4 / 16 runtime workers (WEFT_WORKER_THREADS, and TOKIO_WORKER_THREADS for
#           builds before --worker-threads), pinned: server and client on separate cores, pinned-t4: both);
#           SERVER_STREAMS="64 256" (weft serve vs mlx_lm.server, `weft bench` on both,
#           two requests per stream, prompt 128, 128 generated);
#           servereng: weft serve (its defaults) vs weft bench-engine at SE_STREAMS ("64 256"),
#           SE_ROUNDS (1) each: issue 14's >= 90% of the engine (SE_TRACE=1 keeps the server's
#           scheduler and runner trace as weft-se-N-ROUND.log.gz); SE_BINS="weft_base weft"
#           runs the server of each staged binary after one engine run (A/B in one call; an
#           entry may carry settings as WEFT_BINS' do: weft:WEFT_SHORT_CHUNKS=256); SE_PIN=1
#           runs the engine and the server off the last 4 cores and the bench client on them;
#           SE_REQS (2): requests per stream of the server run (the engine measures its second round of N)
#           (call 2 within the machine's idle window after call 1)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpustash/' .git/info/exclude 2>/dev/null || echo '/.gpustash/' >> .git/info/exclude
M=$(target/release/weft pull)
rm -rf .gpustash/d1 .gpustash/d2 && mkdir -p .gpustash/d1 .gpustash/d2
for b in weft examples/decode_timing examples/paged_attention_check examples/fused_decode_check; do
  n=$(basename $b)
  strip -o .gpustash/$n target/release/$b
  xz -T0 -6 -c .gpustash/$n > .gpustash/d1/$n.xz && rm .gpustash/$n
done
# BASE_WEFT=path/to/an/older/weft stages it as weft_base, for A/B runs in one call
# (WEFT_BINS="weft_base weft": the long and mix steps run once per binary).
# EXTRA_WEFTS="name=path ..." stages more builds the same way (names start
# with weft_; list them in WEFT_BINS too).
for nb in ${BASE_WEFT:+weft_base=$BASE_WEFT} ${EXTRA_WEFTS:-}; do
  n=${nb%%=*}; b=${nb#*=}
  [[ $n == weft_* ]] || { echo "EXTRA_WEFTS: $n does not start with weft_" >&2; exit 1; }
  strip -o .gpustash/$n "$b"
  xz -T0 -6 -c .gpustash/$n > .gpustash/d1/$n.xz && rm .gpustash/$n
done
# The LoRA parity test (mlx-lm as the oracle) runs on the GPU too when built:
# `cargo test -p weft-models --test lora_parity --no-run` first.
LP=$(ls -t target/debug/deps/lora_parity-* target/release/deps/lora_parity-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
if [ -n "$LP" ]; then
  strip -o .gpustash/lora_parity "$LP"
  xz -T0 -6 -c .gpustash/lora_parity > .gpustash/d1/lora_parity.xz && rm .gpustash/lora_parity
fi
# So does the compiled prefill / mixed step test: `cargo test -p weft-models --test compiled_prefill --no-run`.
CP=$(ls -t target/debug/deps/compiled_prefill-* target/release/deps/compiled_prefill-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
if [ -n "$CP" ]; then
  strip -o .gpustash/compiled_prefill "$CP"
  xz -T0 -6 -c .gpustash/compiled_prefill > .gpustash/d1/compiled_prefill.xz && rm .gpustash/compiled_prefill
fi
cp "$M/tokenizer.json" .gpustash/d1/
cat > .gpustash/d2/run.sh <<'EOS'
#!/usr/bin/env bash
set -e
W=/root/ws; O=${OUT:-/tmp}; R=$O/gpu-decode.txt
for n in weft decode_timing paged_attention_check fused_decode_check $(cd $W && ls weft_*.xz 2>/dev/null | sed 's/\.xz$//'); do
  [ -x /root/$n ] || [ ! -f $W/$n.xz ] || { xz -d -c $W/$n.xz > /root/$n && chmod +x /root/$n; }
done
nvidia-smi -L | tee -a $R
git log -1 --format='commit %h %s' 2>/dev/null | tee -a $R || true
export WEFT_OPENBLAS=0 PYTHONUNBUFFERED=1
M=/root/m12; Q=/root/m12q4
S=${STEPS:-decode,engine}
has() { [[ ,$S, == *,$1,* ]]; }
[ -f $M/model.safetensors ] || python3 benches/make_model.py $M --tokenizer $W/tokenizer.json
if has q4 && [ ! -f $Q/model.safetensors ]; then
  python3 benches/make_model.py $Q --tokenizer $W/tokenizer.json --q-bits 4 --q-group 64
fi
if has kernel; then
  echo "== paged kernel vs gather+SDPA (max abs error, times)" | tee -a $R
  /root/paged_attention_check 1,64,256 512,2048 20 2>&1 | tee -a $R
  HEADS=9,3,64 /root/paged_attention_check 1,64 512,2048 10 2>&1 | tee -a $R
  HEADS=16,8,128 DECODE_T=4 /root/paged_attention_check 1,64 512,2048 10 2>&1 | tee -a $R
fi
if has gemv; then
  echo "== few-row matmuls: MLX's vs Weft's GEMV kernels (benches/gemv_probe.py)" | tee -a $R
  python3 benches/gemv_probe.py --rows ${GEMV_ROWS:-1,2,4,8} --cols ${GEMV_COLS:-1,2,4} 2>&1 | tee -a $R
fi
if has gemvstep; then
  for b in ${GEMV_ROWS_STEP:-1 8}; do
    for g in 0 8; do
      echo "== runner decode step, $b rows, pipelined, compiled, WEFT_GEMV_MAX_ROWS=$g" | tee -a $R
      WEFT_GEMV_MAX_ROWS=$g CENSUS=1 PIPELINE=1 /root/decode_timing $M $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
      if has q4; then
        echo "== runner decode step, $b rows, 4-bit, pipelined, compiled, WEFT_GEMV_MAX_ROWS=$g" | tee -a $R
        WEFT_GEMV_MAX_ROWS=$g CENSUS=1 PIPELINE=1 /root/decode_timing $Q $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
      fi
    done
    echo "== compiled steps with the GEMV kernels (WEFT_GEMV_MAX_ROWS=8) vs op-by-op, $b rows" | tee -a $R
    WEFT_GEMV_MAX_ROWS=8 /root/fused_decode_check $M $b 120 24 2>&1 | tail -4 | tee -a $R
    if has q4; then
      WEFT_GEMV_MAX_ROWS=8 /root/fused_decode_check $Q $b 120 24 2>&1 | tail -3 | tee -a $R
    fi
  done
fi
if has check; then
  echo "== compiled (fused kernels) vs op-by-op decode steps, same KV, lockstep" | tee -a $R
  for b in ${CHECK_ROWS:-1 8 64}; do
    /root/fused_decode_check $M $b 120 24 2>&1 | tail -4 | tee -a $R
  done
  if has q4; then
    /root/fused_decode_check $Q 8 120 24 2>&1 | tail -3 | tee -a $R
  fi
fi
if has decode; then
  for b in ${DECODE_ROWS:-1 64 128 256}; do
    echo "== runner decode step, $b rows, 1.2B bf16, device sampling, one step at a time" | tee -a $R
    /root/decode_timing $M $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
    echo "== runner decode step, $b rows, pipelined (each step queued on the last one's picks), compiled" | tee -a $R
    CENSUS=1 PIPELINE=1 /root/decode_timing $M $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
    echo "== runner decode step, $b rows, pipelined, compiled, WEFT_FUSED=off (no fused decode kernels)" | tee -a $R
    CENSUS=1 WEFT_FUSED=off PIPELINE=1 /root/decode_timing $M $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
    echo "== runner decode step, $b rows, pipelined, WEFT_COMPILE=off (op by op)" | tee -a $R
    CENSUS=1 WEFT_COMPILE=off PIPELINE=1 /root/decode_timing $M $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
  done
  for k in ${SPLIT_SWEEP:-}; do
    for b in ${SWEEP_ROWS:-1 64}; do
      echo "== runner decode step, $b rows, pipelined, WEFT_SPLIT_KEYS=$k (fewest keys per attention split; default 128)" | tee -a $R
      WEFT_SPLIT_KEYS=$k PIPELINE=1 /root/decode_timing $M $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
    done
  done
  for o in ${OPS_SWEEP:-}; do
    for b in ${SWEEP_ROWS:-1 64}; do
      echo "== runner decode step, $b rows, pipelined, MLX_MAX_OPS_PER_BUFFER=$o (MLX's default 20)" | tee -a $R
      MLX_MAX_OPS_PER_BUFFER=$o PIPELINE=1 /root/decode_timing $M $b 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
    done
  done
  echo "== runner decode step, 128 rows, host sampling" | tee -a $R
  SAMPLE=host /root/decode_timing $M 128 128 40 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
fi
if has cache; then
  # The engine's step with MLX's buffer cache capped at one decode step (auto) vs uncapped (off),
  # no adapters and 8 (CACHE_STREAMS rows, default 64; prompt 128, gen 128).
  echo "== bench-engine, --mlx-cache-limit auto vs off (steady tok/s, step ms, build ms, eval wait ms)" | tee -a $R
  for cl in ${CACHE_LIMITS:-40MiB auto off}; do
    for ad in "" "--adapters 8 --adapter-rank 16"; do
      /root/weft bench-engine --model $M --streams ${CACHE_STREAMS:-64} --prompt-tokens 128 --gen-tokens 128 \
        --rounds 2 --mlx-cache-limit $cl $ad 2>/dev/null | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); \
        print('cache $cl', '${ad:-no adapters}', round(d['steady_decode_tok_per_s'], 1), round(d['step_ms'], 2), \
        round(d['build_ms'], 2), round(d['eval_ms'], 2))" | tee -a $R
    done
  done
fi
if has lorastep; then
  # The decode step's host time and primitives with 8 mixed adapters vs none (issue 18 item 5).
  # 8: shrinks by matmuls (WEFT_LORA_SHRINK=matmul); 8f: the add-norm and SwiGLU kernels compute
  # them, the output projections' by matmuls (WEFT_LORA_O_SHRINK=matmul); 8p: theirs too (the default).
  i=0
  for a in ${LORASTEP_RUNS:-0 8 8f 0 8 8f}; do
    i=$((i + 1)); export PROFILE_OUT=${PROFILE:+${OUT:-/tmp}/profile-$i-$a.folded}
    echo "== runner decode step, ${LORA_STREAMS:-64} rows, pipelined, compiled, ADAPTERS=$a (rank 16, all projections)" | tee -a $R
    sh=matmul; o=matmul; [[ $a == *[fp] ]] && sh=fused; [[ $a == *p ]] && o=prologue
    WEFT_LORA_O_SHRINK=$o WEFT_LORA_SHRINK=$sh ADAPTERS=${a%[fp]} CENSUS=1 PIPELINE=1 /root/decode_timing $M ${LORA_STREAMS:-64} 128 ${LORASTEP_STEPS:-60} 2>&1 \
      | grep -v '^KV\|^prefill' | tee -a $R
  done
fi
if has engine; then
  echo "== engine vs mlx-lm BatchGenerator, 1.2B bf16, prompt 128, gen 128" | tee -a $R
  python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $M \
    --streams ${STREAMS:-1,8,32,64,128,256} --gen-tokens 128 2>&1 | tail -28 | tee -a $R
fi
if has plain; then
  echo "== engine vs mlx-lm BatchGenerator, 1.2B bf16, WEFT_PIPELINE=off (one step at a time)" | tee -a $R
  WEFT_PIPELINE=off python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $M \
    --streams ${PLAIN_STREAMS:-1,8,64} --gen-tokens 128 2>&1 | tail -28 | tee -a $R
fi
if has nocompile; then
  echo "== engine vs mlx-lm BatchGenerator, 1.2B bf16, WEFT_COMPILE=off (op-by-op decode steps)" | tee -a $R
  WEFT_COMPILE=off python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $M \
    --streams ${PLAIN_STREAMS:-1,8,64} --gen-tokens 128 2>&1 | tail -28 | tee -a $R
fi
if has q4 && [[ -z "${SKIP_Q4_ENGINE:-}" ]]; then
  echo "== engine vs mlx-lm BatchGenerator, 1.2B 4-bit (affine g64), prompt 128, gen 128" | tee -a $R
  # One stream count per run, each bounded, so one slow count cannot take the call's time.
  for n in $(echo ${Q_STREAMS:-${STREAMS:-1,8,32,64,128,256}} | tr , ' '); do
    timeout ${Q_TIMEOUT:-200} python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $Q \
      --streams $n --gen-tokens 128 2>&1 | tail -6 | tee -a $R || echo "streams $n: timed out or failed" | tee -a $R
  done
fi
for g in ${GEMV_SWEEP:-}; do
  echo "== engine vs mlx-lm BatchGenerator, 1.2B bf16, WEFT_GEMV_MAX_ROWS=$g (GEMV kernels up to $g rows; default: 1 row with 4-bit weights, off with dense)" | tee -a $R
  WEFT_GEMV_MAX_ROWS=$g python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $M \
    --streams ${GEMV_STREAMS:-1,8} --gen-tokens 128 2>&1 | tail -28 | tee -a $R
  if has q4; then
    WEFT_GEMV_MAX_ROWS=$g python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $Q \
      --streams ${GEMV_STREAMS:-1,8} --gen-tokens 128 2>&1 | tail -28 | tee -a $R
  fi
done
for r in ${QMM_SWEEP:-}; do
  echo "== engine vs mlx-lm BatchGenerator, 1.2B 4-bit, WEFT_QMM_MAX_ROWS=$r (dequantized from $r rows; default 8)" | tee -a $R
  WEFT_QMM_MAX_ROWS=$r python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $Q \
    --streams ${Q_STREAMS:-1,2,4,8} --gen-tokens 128 2>&1 | tail -28 | tee -a $R
done
if has mixedstep; then
  # The mixed step's fixed cost (issue 17 item 1): 8 decoding rows with a long prompt's
  # chunk each step, at MIXED_DEPTHS and MIXED_CHUNKS, compiled prefill on and off.
  # MIXED_ROWS decoding rows (default 8); MIXED_VARIANTS the settings each runs under (a comma
  # between two of one variant; FRESH=1: each step's chunk a new request's whole prompt).
  # DEPTH 0: the chunk starts fresh (a new request's prompt), then grows.
  mr=${MIXED_ROWS:-8}
  for d in ${MIXED_DEPTHS:-512 5000}; do
    for c in ${MIXED_CHUNKS:-16 256}; do
      for v in ${MIXED_VARIANTS:-WEFT_MIXED=on WEFT_MIXED=off WEFT_COMPILE_PREFILL=off}; do
        echo "== runner step, $mr decoding rows + a $c-token chunk at depth $d, $v" | tee -a $R
        env ${v//,/ } CHUNK=$c DEPTH=$d /root/decode_timing $M $mr 128 20 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
      done
    done
  done
  echo "== runner step, $mr decoding rows alone" | tee -a $R
  /root/decode_timing $M $mr 128 20 2>&1 | grep -v '^KV\|^prefill' | tee -a $R
  # Does the step's cost grow with the pool (a write that cannot update the pool in
  # place copies all of it)? The same mixed step over a pool of MIXED_POOL blocks.
  echo "== runner step, 8 decoding rows + a 16-token chunk at depth 5000, pool of ${MIXED_POOL:-100000} blocks" | tee -a $R
  POOL_BLOCKS=${MIXED_POOL:-100000} CHUNK=16 DEPTH=5000 /root/decode_timing $M 8 128 20 2>&1 | grep -v '^prefill' | tee -a $R
fi
if has attnprobe; then
  echo "== a deep chunk's composed attention: f32 scores vs bf16 scores + precise softmax (benches/composed_attention_probe.py)" | tee -a $R
  python3 benches/composed_attention_probe.py 2>&1 | tee -a $R
fi
if has firstcall; then
  echo "== first call per prefill attention shape: SDPA vs matmul + softmax (benches/attention_first_call.py)" | tee -a $R
  python3 benches/attention_first_call.py 2>&1 | tee -a $R
fi
if has constrained; then
  echo "== constrained output: 32 streams, half JSON-schema constrained vs none (benches/constrained.sh)" | tee -a $R
  WEFT=/root/weft MODEL=$M STREAMS=${C_STREAMS:-32} bash benches/constrained.sh 2>&1 | tee -a $R
fi
if has lora; then
  echo "== LoRA: ${LORA_STREAMS:-64} rows over 8 random rank-16 adapters (all projections) vs none; mlx-lm BatchGenerator with one of them on every row; 1.2B bf16, prompt 128, gen 128" | tee -a $R
  rm -f $O/lora-none.json $O/lora-8.json
  python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $M \
    --streams ${LORA_STREAMS:-64} --gen-tokens 128 --json $O/lora-none.json 2>&1 | tee -a $R
  python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $M \
    --streams ${LORA_STREAMS:-64} --gen-tokens 128 --json $O/lora-8.json \
    --weft-args "--adapters 8 --adapter-rank 16 --adapter-dir /root/lora8" --adapter /root/lora8/adapter-1 2>&1 | tee -a $R
  python3 - $O/lora-none.json $O/lora-8.json <<'PY' | tee -a $R
import json, sys
none, lora = (json.load(open(f)) for f in sys.argv[1:3])
for a, b in zip(none, lora):
    w0, wn, m0, m1 = a["weft"], b["weft"], a["mlx"], b["mlx"]
    n = wn.get("adapters")
    assert n and not w0.get("adapters") and b["mlx_adapter"] and not a["mlx_adapter"], "runs with and without adapters mixed up"
    r = lambda x, y, k: x[k] / y[k]
    for k, what in (("generation_tok_per_s", "gen tok/s (incl. prefill)"), ("steady_decode_tok_per_s", "steady decode tok/s")):
        print(f"{a['streams']} rows, {what}: weft none {w0[k]:.1f}, weft {n} adapters {wn[k]:.1f} "
              f"({r(wn, w0, k):.2f}x of none; target >= 0.8x); mlx-lm none {m0[k]:.1f}, mlx-lm one adapter {m1[k]:.1f} "
              f"({r(m1, m0, k):.2f}x of none); weft {n} adapters / mlx-lm one adapter {r(wn, m1, k):.2f}x")
PY
  if [ -n "${LORA_GATHERED:-}" ]; then
    # The same 8-adapter run with the pool's gathered layout (gather_mm) instead of the dense one.
    echo "== LoRA, WEFT_LORA_LAYOUT=gathered (weft only)" | tee -a $R
    WEFT_LORA_LAYOUT=gathered /root/weft bench-engine --model $M --streams ${LORA_STREAMS:-64} --prompt-tokens 128 \
      --gen-tokens 128 --rounds 2 --adapters 8 --adapter-rank 16 --adapter-dir /root/lora8 | tail -1 | tee -a $R
  fi
fi
if has lorasweep; then
  # Weft alone, the same 64-row (LORA_STREAMS) workload: no adapters, then 8 adapters under each variant.
  echo "== LoRA variants, weft bench-engine only (steady tok/s, step ms, build ms, eval wait ms)" | tee -a $R
  lw() { env "$@" /root/weft bench-engine --model $M --streams ${LORA_STREAMS:-64} --prompt-tokens 128 --gen-tokens 128 \
    --rounds 2 ${LW_ARGS:-} | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print('$*' or 'default', \
    '${LW_ARGS:-none}', round(d['steady_decode_tok_per_s'], 1), round(d['step_ms'], 2), round(d['build_ms'], 2), round(d['eval_ms'], 2))" | tee -a $R; }
  # LORA_ROUNDS (default 1) repeats the whole sequence, so runs of a call's early and late
  # minutes (they drift) pair up.
  for round in $(seq ${LORA_ROUNDS:-1}); do
    LW_ARGS=""
    lw WEFT_X=0
    LW_ARGS="--adapters 8 --adapter-rank 16 --adapter-dir /root/lora8"
    for v in ${LORA_VARIANTS:-WEFT_X=0 MLX_MAX_MB_PER_BUFFER=1000000 WEFT_LORA_LAYOUT=gathered}; do
      lw ${v//,/ }
    done
  done
  LW_ARGS=""
fi
if has hostprof; then
  # Where the host's time goes in a 64-row step: perf's flat profile of bench-engine with no
  # adapters and with 8 (HP_ENV: env settings of the adapter run, commas between them).
  echo "== host profile (perf, flat) of weft bench-engine at 64 rows: none, 8 adapters (${HP_ENV:-as is})" | tee -a $R
  if command -v perf > /dev/null; then
    for v in none lora; do
      a=""; e="WEFT_X=0"
      [ $v = none ] || { a="--adapters 8 --adapter-rank 16 --adapter-dir /root/lora8"; e="${HP_ENV:-WEFT_X=0}"; }
      env ${e//,/ } perf record -F 999 -o /root/perf.$v.data -- /root/weft bench-engine --model $M --streams 64 \
        --prompt-tokens 128 --gen-tokens 128 --rounds 2 $a 2>/dev/null | tail -1 | tee -a $R || true
      perf report -i /root/perf.$v.data --stdio --no-children --sort dso,sym --percent-limit 0.3 2>/dev/null \
        | grep -v '^#' | grep -v '^$' | head -120 > $O/perf_$v.txt || true
      head -40 $O/perf_$v.txt | tee -a $R
    done
  else
    echo "no perf here: $(ls /usr/bin /usr/local/bin 2>/dev/null | grep -i -E '^(perf|nsys|gdb|py-spy)' | tr '\n' ' ')" | tee -a $R
  fi
fi
if has adapterpar; then
  # The test finds its oracle script under the path it was built at.
  echo "== LoRA parity on the GPU: crates/models/tests/lora_parity.rs (mlx-lm with the adapter loaded as the oracle)" | tee -a $R
  xz -d -c $W/lora_parity.xz > /root/lora_parity && chmod +x /root/lora_parity
  [ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
  # Each test makes its fixture and runs the oracle on the GPU (~2 min each): LP_FILTER picks them.
  # The oracle (mlx-lm) on the CPU: exact f32, no CUDA start per call; Weft's side runs on the GPU.
  WEFT_ORACLE_DEVICE=${WEFT_ORACLE_DEVICE:-cpu} WEFT_PYTHON=$(command -v python3) \
    timeout ${LP_TIMEOUT:-400} /root/lora_parity ${LP_FILTER-compiled_decode} --nocapture --test-threads 1 2>&1 \
    | grep --line-buffered -E "^test |max \|dlogprob\||test result|panicked|differ" | tee -a $R || true
fi
if has mixedpar; then
  echo "== compiled prefill and mixed steps vs op-by-op on the GPU: crates/models/tests/compiled_prefill.rs" | tee -a $R
  xz -d -c $W/compiled_prefill.xz > /root/compiled_prefill && chmod +x /root/compiled_prefill
  [ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
  WEFT_TEST_TOLERANCE=${WEFT_TEST_TOLERANCE:-1e-3} WEFT_ORACLE_DEVICE=${WEFT_ORACLE_DEVICE:-cpu} WEFT_PYTHON=$(command -v python3) \
    timeout ${MP_TIMEOUT:-300} /root/compiled_prefill ${MP_FILTER-mixed} --nocapture --test-threads 1 2>&1 \
    | grep --line-buffered -E "^test |max \||test result|panicked|left|right|Err|called |step:" | tee -a $R || true
  # MP_GDB=1: the first failing test again under gdb (cuda-gdb where the machine has
  # no gdb), launches synchronous (no CUDA graphs): a backtrace at the failing CUDA
  # call and at the first C++ throw names the primitive whose launch failed.
  G=$(command -v gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null || true)
  if [ -n "${MP_GDB:-}" ] && [ -n "$G" ]; then
    MLX_USE_CUDA_GRAPHS=0 WEFT_TEST_TOLERANCE=${WEFT_TEST_TOLERANCE:-1e-3} WEFT_ORACLE_DEVICE=${WEFT_ORACLE_DEVICE:-cpu} WEFT_PYTHON=$(command -v python3) \
      timeout ${MP_TIMEOUT:-300} "$G" -q -batch -ex "set pagination off" -ex "set cuda api_failures stop" -ex "catch throw" \
      -ex run -ex bt -ex continue -ex bt --args /root/compiled_prefill ${MP_GDB_FILTER:-mixed_steps_match} --nocapture --test-threads 1 \
      > $O/mixedpar-gdb.log 2>&1 || true
    grep -E "^#[0-9]+ |Catchpoint|API error|signal" $O/mixedpar-gdb.log | head -80 | tee -a $R || true
  fi
  if [ -n "${MP_NOGRAPH:-}" ]; then
    echo "-- again with MLX_USE_CUDA_GRAPHS=0" | tee -a $R
    MLX_USE_CUDA_GRAPHS=0 WEFT_TEST_TOLERANCE=${WEFT_TEST_TOLERANCE:-1e-3} WEFT_ORACLE_DEVICE=${WEFT_ORACLE_DEVICE:-cpu} WEFT_PYTHON=$(command -v python3) \
      timeout ${MP_TIMEOUT:-300} /root/compiled_prefill ${MP_FILTER-mixed} --nocapture --test-threads 1 2>&1 \
      | grep --line-buffered -E "^test |max \||test result|panicked|Err|called |step:" | tee -a $R || true
  fi
fi
if has hybrid; then
  H=/root/q35
  [ -f $H/model.safetensors ] || python3 benches/make_model.py $H --tokenizer $W/tokenizer.json --arch qwen3_5
  echo "== engine vs mlx-lm BatchGenerator, Qwen3.5-shaped hybrid bf16, prompt 128, gen 128" | tee -a $R
  python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $H \
    --streams ${HYBRID_STREAMS:-1,8,32,64} --gen-tokens 128 2>&1 | tail -12 | tee -a $R
fi
if has kvq; then
  for bits in 8 4; do
    echo "== paged decode kernel over ${bits}-bit KV vs gather + dequantize + SDPA" | tee -a $R
    KV_BITS=$bits /root/paged_attention_check 1,64,128 512,2048 10 2>&1 | tee -a $R
  done
  echo "== quantized KV, weft bench-engine ${KVQ_STREAMS:-128} streams (steady tok/s, step ms)" | tee -a $R
  kq() { env "$@" /root/weft bench-engine --model $M --streams ${KVQ_STREAMS:-128} --prompt-tokens 128 \
    --gen-tokens 128 --rounds 2 ${KQ_ARGS:-} | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); \
    print('$*', '${KQ_ARGS:-bf16 KV}', round(d['steady_decode_tok_per_s'], 1), round(d['step_ms'], 2))" | tee -a $R; }
  kq WEFT_X=0
  for bits in 8 4; do
    KQ_ARGS="--kv-bits $bits"
    kq WEFT_X=0
    kq WEFT_KV_QUANT_KERNEL=0
  done
  KQ_ARGS=""
fi
# A WEFT_BINS entry is a staged binary, optionally with settings: weft_base, or
# weft:WEFT_COMPILE_PREFILL=off,WEFT_PIPELINE=off (B: the binary, VENV: the
# settings, TAG: a file-name form of the entry).
variant() {
  B=${1%%:*}; VENV=()
  if [[ $1 == *:* ]]; then IFS=, read -r -a VENV <<< "${1#*:}"; fi
  TAG=$(echo "$1" | tr -c 'A-Za-z0-9_\n' '_')
  # A binary listed twice (runs of one binary differ): the second run's files get -2, -3...
  local base=$TAG n=2
  while [ -e "$O/long-trace-$TAG.log.gz" ] || compgen -G "$O/mix-*-$TAG.json" > /dev/null; do TAG=$base-$n; n=$((n + 1)); done
}
if has long; then
  echo "== steps bounded in time: 8 streams decode while a 2048- and a 7000-token prompt join, then a 7000-token prompt is cancelled mid-prefill (weft bench-engine --scenario long-prompts), 1.2B bf16" | tee -a $R
  for V in ${WEFT_BINS:-weft}; do
  variant "$V"
  echo "-- /root/$B ${VENV[*]}" | tee -a $R
  if [ -n "${LONG_TRACE:-}" ]; then
    # The scheduler's per-step trace ("step cost": each step's shape and seconds), kept whole.
    env "${VENV[@]}" RUST_LOG=warn,weft_scheduler=trace,weft_models::runner=trace /root/$B bench-engine --scenario long-prompts --model $M > $O/long-trace-$TAG.log 2>&1 || true
    tail -4 $O/long-trace-$TAG.log | tee -a $R
    gzip -f $O/long-trace-$TAG.log
  else
    env "${VENV[@]}" /root/$B bench-engine --scenario long-prompts --model $M 2>&1 | tail -4 | tee -a $R
  fi
  done
fi
up() { python3 - "$1" <<'PY'
import sys, time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=1); sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(1)
PY
}
if has mix; then
  # MIX_WINDOWS: --isolation-window-ms values to run one after the other (default: 5000 0,
  # the isolation window on, then off).
  for V in ${WEFT_BINS:-weft}; do
  variant "$V"
  for win in ${MIX_WINDOWS:-5000 0}; do
  echo "== tenant isolation in latency: weft bench --scenario tenant-mix, ${MIX_FLOOD:-48} flood streams, 1.2B bf16, --isolation-window-ms $win, /root/$B ${VENV[*]}" | tee -a $R
  # MIX_TRACE=1: the scheduler's and the runner's per-step trace in the server's log
  # (weft-mix-WIN-TAG.log.gz).
  env ${MIX_TRACE:+RUST_LOG=info,weft_scheduler=trace,weft_models::runner=trace} "${VENV[@]}" /root/$B serve --model $M --tenants benches/tenant-mix.toml --listen 127.0.0.1:50561 --metrics-listen 127.0.0.1:50563 --http-listen off \
    --isolation-window-ms $win > $O/weft-mix-$win.log 2>&1 &
  P=$!
  up http://127.0.0.1:50563/metrics
  for _ in $(seq 240); do grep -q "ready: serving" $O/weft-mix-$win.log && break; sleep 0.5; done
  /root/weft bench --scenario tenant-mix --target grpc://127.0.0.1:50561 --tenant flood:flood-key --tenant light:light-key \
    --flood-streams ${MIX_FLOOD:-48} --phase-duration ${MIX_PHASE:-30s} --warmup 8 --quiet --json $O/mix-$win-$TAG.json 2>&1 | tee -a $R
  kill -TERM $P; wait $P || true
  if [ -n "${MIX_TRACE:-}" ]; then mv $O/weft-mix-$win.log $O/weft-mix-$win-$TAG.log && gzip -f $O/weft-mix-$win-$TAG.log; fi
  done
  done
fi
if has soak; then
  # SOAK_VARIANTS: one server per entry, "default" or settings (ENV=VAL,ENV2=VAL2), e.g.
  # "default WEFT_MLX_MEMORY_LIMIT=off" (MLX's memory limit from the plan vs MLX's own).
  for v in ${SOAK_VARIANTS:-default}; do
    SV=(); [ "$v" = default ] || IFS=, read -ra SV <<< "$v"
    echo "== soak ($v): weft bench --scenario soak for ${SOAK_DURATION:-300s}, 1.2B bf16, 32 workers, two tenants" | tee -a $R
    env "${SV[@]}" RUST_LOG=info,weft_grpc::memory_plan=debug /root/weft serve --model $M --tenants benches/tenant-mix.toml --listen 127.0.0.1:50571 --metrics-listen 127.0.0.1:50573 --http-listen off > $O/weft-soak.log 2>&1 &
    P=$!
    up http://127.0.0.1:50573/metrics
    for _ in $(seq 240); do grep -q "ready: serving" $O/weft-soak.log && break; sleep 0.5; done
    grep "memory plan" $O/weft-soak.log | tee -a $R
    /root/weft bench --scenario soak --target grpc://127.0.0.1:50571 --metrics-url http://127.0.0.1:50573/metrics \
      --tenant flood:flood-key:3 --tenant light:light-key:1 -c 32 --duration ${SOAK_DURATION:-300s} --sample-every 15s \
      --prompt-tokens uniform:16:2000 --max-tokens uniform:4:256 --json $O/soak.json 2>&1 | tee -a $R
    kill -TERM $P; wait $P || true
    grep "peak grew" $O/weft-soak.log | cut -c1-400 | tee -a $R
  done
fi
if has split64; then
  # Where the server's 64-stream gap to the engine goes: bench-engine at 64
  # streams, then one `weft serve` per variant (default; server and bench
  # client on separate cores; that plus TOKIO_WORKER_THREADS=4), each with the
  # server's per-step forward split read from its /metrics after the bench.
  C=$(nproc)
  echo "== server vs engine at 64 streams, variants (nproc $C)" | tee -a $R
  /root/weft bench-engine --model $M --streams 64 --gen-tokens 128 --rounds 2 2>&1 | tail -5 | tee -a $R
  A="--prompt-tokens 128 --max-tokens 128 --warmup 2 --quiet"
  for v in ${SPLIT_VARIANTS:-default pinned pinned-t4 default}; do
    SP=""; CP=""; TW=""
    case $v in
      t4) TW=4 ;;
      w16) TW=16 ;;
      pinned) SP="taskset -c 0-$((C - 5))"; CP="taskset -c $((C - 4))-$((C - 1))" ;;
      pinned-t4) SP="taskset -c 0-$((C - 5))"; CP="taskset -c $((C - 4))-$((C - 1))"; TW=4 ;;
    esac
    env ${TW:+TOKIO_WORKER_THREADS=$TW WEFT_WORKER_THREADS=$TW} $SP /root/weft serve --model $M --listen 127.0.0.1:50581 --metrics-listen 127.0.0.1:50583 \
      --http-listen off --max-batch-rows 64 > $O/weft-split-$v.log 2>&1 &
    P=$!
    up http://127.0.0.1:50583/metrics
    for _ in $(seq 240); do grep -q "ready" $O/weft-split-$v.log && break; sleep 0.5; done
    $CP /root/weft bench --target grpc://127.0.0.1:50581 -c 64 -n 128 $A --json $O/split-$v.json > /dev/null
    python3 - "$v" "$O/split-$v.json" <<'PY' | tee -a $R
import json, sys, urllib.request
v, f = sys.argv[1], sys.argv[2]
d = json.load(open(f))['overall']
m = {}
for l in urllib.request.urlopen('http://127.0.0.1:50583/metrics').read().decode().splitlines():
    for k in ('weft_forward_build_seconds', 'weft_forward_eval_seconds', 'weft_forward_other_seconds', 'weft_step_duration_seconds'):
        if l.startswith(k + '_sum') or l.startswith(k + '_count'):
            m[l.split()[0].split('{')[0]] = m.get(l.split()[0].split('{')[0], 0) + float(l.split()[-1])
per = lambda k: 1e3 * m.get(k + '_sum', 0) / max(m.get(k + '_count', 1), 1)
print(f"{v}: {d['output_tokens_per_s']:.1f} tok/s, TTFT p50/p99 {d['ttft_ms']['p50']:.0f}/{d['ttft_ms']['p99']:.0f} ms, "
      f"ITL p50/p99 {d['itl_ms']['p50']:.1f}/{d['itl_ms']['p99']:.1f} ms; per forward (incl. warm-up): build {per('weft_forward_build_seconds'):.2f}, "
      f"eval {per('weft_forward_eval_seconds'):.2f}, other {per('weft_forward_other_seconds'):.2f} ms; "
      f"per step {per('weft_step_duration_seconds'):.2f} ms over {int(m.get('weft_step_duration_seconds_count', 0))} steps")
PY
    kill -TERM $P; wait $P || true
  done
fi
if has servereng; then
  # Issue 14's server target: `weft serve` (its defaults) at >= 90% of `weft bench-engine`,
  # both at SE_STREAMS (64 256), prompt 128, 128 generated; the engine first, then a fresh
  # server driven by `weft bench` (two requests per stream), SE_ROUNDS times each.
  # SE_PIN=1: the engine bench and the server on all cores but the last 4, the bench
  # client on those 4 (a load generator shares no cores with the server it measures).
  A="--prompt-tokens 128 --max-tokens 128 --warmup 2 --quiet"
  SP=""; CP=""
  if [ -n "${SE_PIN:-}" ]; then
    C=$(nproc); SP="taskset -c 0-$((C - 5))"; CP="taskset -c $((C - 4))-$((C - 1))"
  fi
  for n in ${SE_STREAMS:-64 256}; do
    for round in $(seq ${SE_ROUNDS:-1}); do
      echo "== weft serve vs weft bench-engine, $n streams, round $round${SE_PIN:+, pinned}" | tee -a $R
      $SP /root/weft bench-engine --model $M --streams $n --prompt-tokens 128 --gen-tokens 128 --rounds 2 2>/dev/null \
        | tail -1 > $O/se-engine-$n-$round.json
      # SE_TRACE=1: the scheduler's and the runner's per-step trace (weft-se-N-ROUND.log.gz).
      # SE_BINS entries as WEFT_BINS' (a binary, optionally with settings: weft:WEFT_SHORT_CHUNKS=1024).
      for V in ${SE_BINS:-weft}; do
      variant "$V"; bin=$TAG
      L=$O/$bin-se-$n-$round.log
      env ${SE_TRACE:+RUST_LOG=info,weft_scheduler=trace,weft_models::runner=trace} "${VENV[@]}" $SP /root/$B serve --model $M \
        --listen 127.0.0.1:50591 --metrics-listen 127.0.0.1:50593 --http-listen off \
        --max-batch-rows $n > $L 2>&1 &
      P=$!
      up http://127.0.0.1:50593/metrics
      for _ in $(seq 240); do grep -q "ready" $L && break; sleep 0.5; done
      $CP /root/weft bench --target grpc://127.0.0.1:50591 -c $n -n $((${SE_REQS:-2} * n)) $A --json $O/se-serve-$bin-$n-$round.json > /dev/null
      curl -s http://127.0.0.1:50593/metrics | grep -E "^weft_(steps_pipelined|admissions_[a-z]*)_total" > $O/se-metrics-$bin-$n-$round.txt || true
      kill -TERM $P; wait $P || true
      if [ -n "${SE_TRACE:-}" ]; then gzip -f $L; fi
      python3 - $n $bin $O/se-engine-$n-$round.json $O/se-serve-$bin-$n-$round.json $O/se-metrics-$bin-$n-$round.txt <<'PY' | tee -a $R
import json, sys
n, b, e, s = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])), json.load(open(sys.argv[4]))['overall']
m = ' '.join(l.strip() for l in open(sys.argv[5]))
g = e['generation_tok_per_s']
print(f"{n} streams, {b}: engine gen {g:.1f} tok/s (steady {e['steady_decode_tok_per_s']:.1f}); server "
      f"{s['output_tokens_per_s']:.1f} tok/s = {100 * s['output_tokens_per_s'] / g:.1f}% of the engine "
      f"(target >= 90%), ok {s.get('ok')} errors {s.get('errors')}, TTFT p50/p99 "
      f"{s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms, ITL p50/p99 {s['itl_ms']['p50']:.1f}/{s['itl_ms']['p99']:.1f} ms; {m}")
PY
      done
    done
  done
fi
if has server; then
  echo "== weft serve vs mlx_lm.server, 1.2B bf16, prompt 128, 128 generated, 2 requests per stream" | tee -a $R
  A="--prompt-tokens 128 --max-tokens 128 --warmup 2 --quiet"
  for n in ${SERVER_STREAMS:-64 256}; do
    /root/weft serve --model $M --listen 127.0.0.1:50551 --metrics-listen 127.0.0.1:50553 --max-batch-rows $n > $O/weft-serve-$n.log 2>&1 &
    P=$!
    up http://127.0.0.1:50553/metrics
    for _ in $(seq 240); do grep -q "ready" $O/weft-serve-$n.log && break; sleep 0.5; done
    /root/weft bench --target grpc://127.0.0.1:50551 -c $n -n $((2 * n)) $A --json $O/weft-$n.json > /dev/null
    kill -TERM $P; wait $P || true
    python3 -m mlx_lm.server --model $M --port 50552 > $O/mlx-server-$n.log 2>&1 &
    P=$!
    up http://127.0.0.1:50552/v1/models
    /root/weft bench --target http://127.0.0.1:50552 --api openai -c $n -n $((2 * n)) $A --json $O/mlx-$n.json > /dev/null
    kill $P; wait $P || true
    for side in weft mlx; do
      python3 -c "
import json; d=json.load(open('$O/$side-$n.json'))['overall']
print(json.dumps({'side': '$side', 'streams': $n, 'ok': d.get('ok'), 'errors': d.get('errors'),
  'output_tok_s': round(d.get('output_tokens_per_s', 0), 1), 'ttft_p50_ms': d['ttft_ms']['p50'],
  'ttft_p99_ms': d['ttft_ms']['p99'], 'itl_p50_ms': d['itl_ms']['p50'], 'itl_p99_ms': d['itl_ms']['p99']}))" | tee -a $R
    done
  done
fi
EOS
chmod +x .gpustash/d2/run.sh
du -sb .gpustash/d1 .gpustash/d2
