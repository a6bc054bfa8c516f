#!/usr/bin/env bash
# Sampler measurements for one NVIDIA H200 (issue: sampler at real model size). About 7 minutes in all (each command has its own time limit).
# Every command prints one JSON line last; run from the repository root:  bash benchmarks/gpu_sampler.sh
# Goals: 0.5B bf16, 256 slots, steady state >= 60k generated tokens/s and >= 30x HF generate on the same GPU;
# 1.5B: 16k-token generations with >= 128 sequences at once.
set -u
OUT=${OUT:-/tmp/gpu_sampler}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}
run() {  # name, seconds, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: python benchmarks/sampler.py $*"
  timeout "$limit" python benchmarks/sampler.py "$@" > "$OUT/$name.txt" 2>&1
  echo "   exit $?"; tail -n 12 "$OUT/$name.txt"
}
# Compiled programs are cached on disk, so later runs of the same shapes skip most compilation.
export JAX_COMPILATION_CACHE_DIR="$OUT/jax_cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
# 1. 0.5B bf16, 256 slots: the workload (prompts 64-128, log-normal lengths, median 256, cap 1024),
#    continuous vs static, HF generate on the same GPU (128 prompts in one batch), then 15 s of steady state.
run q05_k16 170 --preset qwen2.5-0.5b --dtype bfloat16 --num-slots 256 --num-prompts 512 --decode-steps 16 \
  --hf-prompts 128 --steady --warmup-seconds 5 --steady-seconds 15
# 2. steady state at k = 8, and at k = 16 with each dispatch fetched before the next is issued (no fetch-behind):
#    tokens/s, occupancy and the update latency against k and the pipelining.
run q05_k8 50 --preset qwen2.5-0.5b --num-slots 256 --num-prompts 256 --decode-steps 8 --skip-static --skip-hf \
  --steady --warmup-seconds 5 --steady-seconds 10
run q05_k16_sync 50 --preset qwen2.5-0.5b --num-slots 256 --num-prompts 256 --decode-steps 16 --no-fetch-behind \
  --skip-static --skip-hf --steady --warmup-seconds 5 --steady-seconds 10
# 3. the paged KV cache (pages of 16, the Pallas GPU paged-attention kernel) in the same steady state, and the
#    decode step over pages (gather path and kernel) against the dense cache at long contexts (benchmark model).
run q05_paged 60 --preset qwen2.5-0.5b --num-slots 256 --num-prompts 256 --decode-steps 16 --kv-cache paged \
  --skip-static --skip-hf --steady --warmup-seconds 5 --steady-seconds 10
echo "== decode_attention --paged"
timeout 60 python benchmarks/decode_attention.py --dtype bfloat16 --rows 64 --cache-lens 1024 8192 --paged \
  --prefill-rows 0 --repeats 10 > "$OUT/decode_attention_paged.txt" 2>&1; echo "   exit $?"
tail -n 6 "$OUT/decode_attention_paged.txt"
# 4. 1.5B bf16, 128 sequences of 16,384 new tokens each (dense cache: 128 x 16,512 positions, ~61 GB bf16),
#    stopped after 45 s: the tokens generated and the rate while contexts grow (the roofline line assumes the
#    whole generation, so read it as an upper bound here).
run q15_long 110 --preset qwen2.5-1.5b --num-slots 128 --num-prompts 128 --max-new-tokens 16384 \
  --median-new-tokens 16384 --sigma 0 --decode-steps 32 --max-seconds 45 --skip-hf
echo "results in $OUT"
