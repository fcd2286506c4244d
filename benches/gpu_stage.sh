#!/usr/bin/env bash
# Stages the engine benchmark for a GPU machine that has no registry or hub
# access and takes at most 64 MiB per call: the default model in three parts,
# the stripped `weft` binary and a run script, under .gpustash/ (git-ignored).
# MLX's CUDA build (PyPI mlx-cuda-13) and mlx-lm travel separately as .gpu/a
# and .gpu/b, whose env.sh puts them on LD_LIBRARY_PATH / PYTHONPATH.
#
#   bash benches/gpu_stage.sh          # here, after `cargo build --release`
#   call 1: carry .gpu/a .gpustash/1   bash .gpu/a/stash.sh && mkdir -p /root/ws && cp .gpustash/1/* /root/ws/
#   call 2: carry .gpustash/2          cp .gpustash/2/* .gpustash/2/.weft-complete /root/ws/
#   call 3: carry .gpu/b .gpustash/3   bash .gpu/b/env.sh bash .gpustash/3/run.sh
#           (RUNS=$'\n--speculate 4' for a default run, then one with those flags)
# (each call within the machine's idle window of the one before).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpustash/' .git/info/exclude 2>/dev/null || echo '/.gpustash/' >> .git/info/exclude
M=$(target/release/weft pull)
rm -rf .gpustash && mkdir -p .gpustash/1 .gpustash/2 .gpustash/3
part() { dd if="$M/model.safetensors" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count=$3} status=none; }
part .gpustash/1/model.part1 0 24000000
part .gpustash/2/model.part2 24000000 55000000
part .gpustash/3/model.part3 79000000
sha256sum "$M/model.safetensors" | cut -d' ' -f1 > .gpustash/3/model.sha256
cp "$M"/*.json .gpustash/2/
cp "$M/.weft-complete" .gpustash/2/ 2>/dev/null || true
strip -o .gpustash/weft target/release/weft
xz -T0 -6 -c .gpustash/weft > .gpustash/3/weft.xz && rm .gpustash/weft
cat > .gpustash/3/run.sh <<'EOS'
#!/usr/bin/env bash
set -e
W=/root/ws; M=/root/model/SmolLM2-135M-Instruct
mkdir -p $M
cat $W/model.part1 $W/model.part2 .gpustash/3/model.part3 > $M/model.safetensors
echo "$(cat .gpustash/3/model.sha256)  $M/model.safetensors" | sha256sum -c --quiet
cp $W/*.json $M/ && { cp $W/.weft-complete $M/ 2>/dev/null || true; }
xz -d -c .gpustash/3/weft.xz > /root/weft && chmod +x /root/weft
nvidia-smi -L
export WEFT_OPENBLAS=0
# RUNS: one --weft-args string per line ("" = the defaults); each run's table
# also goes under $OUT as it finishes, so a call cut short keeps what ran.
while IFS= read -r args; do
  echo "== weft args: ${args:-(none)}" | tee -a ${OUT:-/tmp}/gpu-runs.txt
  python3 benches/batch_throughput.py --native --rounds 3 --weft /root/weft --model $M \
    --streams ${STREAMS:-1,8,32} --weft-args "$args" 2>&1 | tail -12 | tee -a ${OUT:-/tmp}/gpu-runs.txt
done <<< "${RUNS:-}"
EOS
chmod +x .gpustash/3/run.sh
du -sb .gpustash/*
