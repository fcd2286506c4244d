#!/usr/bin/env bash
# Stages the paged-KV GPU runs (kernel check, decode step timing with rows
# leaving, engine vs mlx-lm at 1.2B) for the device machine, under .gpustash/p
# (git-ignored). MLX's CUDA build travels as .gpu/a and .gpu/b
# (../shared/gpu/prepare.sh-style staging); the model is made on the device.
#
#   bash benches/gpu_paged.sh            # here, after `cargo build --release -p weft-grpc -p weft-models --examples --bins`
#   call 1: carry .gpu/a .gpustash/p1    bash .gpu/a/stash.sh && mkdir -p /root/ws && cp .gpustash/p1/* /root/ws/
#   call 2: carry .gpu/b .gpustash/p2    bash .gpu/b/env.sh bash .gpustash/p2/run.sh
#           (STEPS=kernel,decode,donate,engine picks parts; STREAMS=64,128,256)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpustash/' .git/info/exclude 2>/dev/null || echo '/.gpustash/' >> .git/info/exclude
M=$(target/release/weft pull)
rm -rf .gpustash/p1 .gpustash/p2 && mkdir -p .gpustash/p1 .gpustash/p2
for b in weft examples/decode_timing examples/paged_attention_check; do
  n=$(basename $b)
  strip -o .gpustash/$n target/release/$b
  xz -T0 -6 -c .gpustash/$n > .gpustash/p1/$n.xz && rm .gpustash/$n
done
cp "$M/tokenizer.json" .gpustash/p1/
cat > .gpustash/p2/run.sh <<'EOS'
#!/usr/bin/env bash
set -e
W=/root/ws; O=${OUT:-/tmp}
for n in weft decode_timing paged_attention_check; do
  [ -x /root/$n ] || { xz -d -c $W/$n.xz > /root/$n && chmod +x /root/$n; }
done
nvidia-smi -L
export WEFT_OPENBLAS=0 PYTHONUNBUFFERED=1
M=/root/m12
[ -f $M/model.safetensors ] || python3 benches/make_model.py $M --tokenizer $W/tokenizer.json
S=${STEPS:-kernel,decode,engine}
if [[ $S == *kernel* ]]; then
  echo "== paged kernel vs gather+SDPA" | tee -a $O/gpu-paged.txt
  /root/paged_attention_check 1,64,256 512,2048,8192 20 2>&1 | tee -a $O/gpu-paged.txt
  DECODE_T=4 /root/paged_attention_check 8,64 512,2048 20 2>&1 | tee -a $O/gpu-paged.txt
fi
if [[ $S == *decode* ]]; then
  echo "== decode step, 128 rows, 1.2B bf16" | tee -a $O/gpu-paged.txt
  /root/decode_timing $M 128 128 40 2>&1 | tee -a $O/gpu-paged.txt
  echo "== decode step, 128 rows, one row leaving per step" | tee -a $O/gpu-paged.txt
  LEAVE=1 /root/decode_timing $M 128 128 40 2>&1 | tee -a $O/gpu-paged.txt
fi
if [[ $S == *donate* ]]; then
  # The same step with a pool ~100x larger: equal times mean writes update the
  # pool in place (a copy of ~70 GB per step would take tens of ms).
  echo "== decode step, 128 rows, pool of 200000 blocks (70 GB)" | tee -a $O/gpu-paged.txt
  POOL_BLOCKS=200000 /root/decode_timing $M 128 128 40 2>&1 | tee -a $O/gpu-paged.txt
fi
if [[ $S == *engine* ]]; then
  echo "== engine vs mlx-lm BatchGenerator, 1.2B bf16, prompt 128, gen 128" | tee -a $O/gpu-paged.txt
  python3 benches/batch_throughput.py --native --rounds 2 --weft /root/weft --model $M \
    --streams ${STREAMS:-64,128,256} --gen-tokens 128 2>&1 | tail -14 | tee -a $O/gpu-paged.txt
fi
EOS
chmod +x .gpustash/p2/run.sh
du -sb .gpustash/p1 .gpustash/p2
