#!/usr/bin/env bash
# Issue #14's accelerator figures in one call (~5 minutes on one H200; nothing is downloaded):
#   1. Qwen2.5-0.5B shape (random weights), train + rollout colocated on one GPU: eta 0 vs eta 4 trained
#      and generated tokens/s, occupancy, trainer wait, staleness; hand-off vs a raw copy of the same
#      bytes; memory per part (shapes and memory_stats); timeline.json -> timeline PNG.
#   2. Qwen2.5-1.5B shape: one step at the full KV cache (64 slots x 8k) to show what fits (memory per part).
# Usage: OUT=/some/dir bash benchmarks/gpu_loop.sh   (OUT defaults to runs/gpu_loop)
# Lengths are smaller than the preset defaults (median 1k, cap 8k) so that both runs fit the time box;
# run the defaults with: python benchmarks/loop.py --preset qwen2.5-0.5b --etas 0,4
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_loop}
mkdir -p "$OUT"
export AREAL_JAX_COMPILE_CACHE="$OUT/xla-cache"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>/dev/null || true
python -c "import jax; print(jax.devices())"

echo "== 1. qwen2.5-0.5b, eta 0 vs eta 4 =="
timeout 240 python benchmarks/loop.py --preset qwen2.5-0.5b --etas 0,4 --steps 4 --warmup_steps 1 \
  --median 512 --cap 4096 --out "$OUT/loop_0.5b" > "$OUT/loop_0.5b.log" 2>&1
echo "exit $?"; tail -n 8 "$OUT/loop_0.5b.log" | cut -c1-2000
tail -n 1 "$OUT/loop_0.5b.log" > "$OUT/loop_0.5b.json"
python -m areal_jax.programs.report "$OUT/loop_0.5b/eta4" 2>&1 | tail -n 3
rm -rf "$OUT/loop_0.5b/model_qwen2.5-0.5b" "$OUT/loop_0.5b/warmup"   # random weights: not worth fetching

echo "== 2. qwen2.5-1.5b memory at 64 slots x 8k =="
timeout 150 python benchmarks/loop.py --preset qwen2.5-1.5b --etas 4 --steps 1 --warmup_steps 0 \
  --median 32 --cap 8192 --out "$OUT/mem_1.5b" > "$OUT/mem_1.5b.log" 2>&1
echo "exit $?"; tail -n 4 "$OUT/mem_1.5b.log" | cut -c1-2000
tail -n 1 "$OUT/mem_1.5b.log" > "$OUT/mem_1.5b.json"
rm -rf "$OUT/mem_1.5b/model_qwen2.5-1.5b" "$OUT/xla-cache"
