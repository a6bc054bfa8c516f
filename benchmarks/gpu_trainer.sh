#!/usr/bin/env bash
# The trainer issue's accelerator figures in one call (~8 minutes on one H200; nothing is downloaded).
#   0. The Pallas flash kernel compiled for the GPU against dense attention (values and gradients, f32 and
#      bf16, packed rows with GQA): if this fails, every later run with attention=auto/flash is void.
#   1. Qwen2.5-0.5B shape, bf16 compute, float32 params: Trainer.update vs HF + PyTorch (autocast bf16) on
#      the SAME GPU, the issue's workload (128 trajectories, 61,858 tokens, micro_batch_tokens 16384),
#      attention auto (= flash on a GPU); a jax.profiler trace of one update; then the same update with
#      dense attention (JAX only) to compare the kernels.
#   2. Qwen2.5-1.5B shape at micro_batch_tokens 16384 (64 trajectories), against PyTorch on the same GPU
#      (again with remat dots if it does not fit without).
#   3. Qwen2.5-0.5B at micro_batch_tokens 65536 with remat full.
#   4. One 32,768-token trajectory (0.5B, remat full).
# Each step prints its benchmark's last line (one JSON object) into $OUT/<name>.json.
# Usage: OUT=/some/dir bash benchmarks/gpu_trainer.sh   (OUT defaults to runs/gpu_trainer)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_trainer}
mkdir -p "$OUT"
export AREAL_JAX_COMPILE_CACHE="$OUT/xla-cache"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # PyTorch's engine shares the GPU
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>/dev/null || true
python -c "import jax, torch; print(jax.devices(), 'torch cuda:', torch.cuda.is_available())"

step() {  # step NAME TIMEOUT_S COMMAND...: run, keep the log, print its tail, save the last line as JSON
  local name=$1 limit=$2 rc; shift 2
  echo "== $name =="
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "exit $rc"
  tail -n 8 "$OUT/$name.log" | cut -c1-3000
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
  return $rc
}

step flash_check 90 python - <<'EOF'
import json, jax, jax.numpy as jnp, numpy as np
from areal_jax.models.flash_attention import flash_attention
from areal_jax.models.layers import dot_attention
from areal_jax.models.packed_attention import packed_mask
rng = np.random.default_rng(0)
b, t, h, kv, d = 2, 2048, 14, 2, 64
seg = np.zeros((b, t), np.int32)
for r in range(b):
    pos, sid = 0, 1
    while pos < t - 100:
        n = int(min(rng.integers(50, 700), t - 100 - pos)); seg[r, pos:pos + n] = sid; pos += n; sid += 1
seg = jnp.asarray(seg)
out = {"phase": "flash_check", "device": jax.devices()[0].device_kind}
for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), dtype) for n in (h, kv, kv))
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, seg).astype(jnp.float32) * w)
    g = lambda q, k, v: jnp.sum(dot_attention(q, k, v, packed_mask(seg)).astype(jnp.float32) * w)
    a = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)
    r = jax.jit(jax.value_and_grad(g, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
    name = jnp.dtype(dtype).name
    o1 = flash_attention(q, k, v, seg).astype(jnp.float32)
    o2 = dot_attention(*(x.astype(jnp.float32) for x in (q, k, v)), packed_mask(seg))
    out[f"{name}_max_abs_err_out"] = float(jnp.max(jnp.abs(o1 - o2)))
    for i, n in enumerate("qkv"):
        err = jnp.max(jnp.abs(a[1][i].astype(jnp.float32) - r[1][i])) / jnp.max(jnp.abs(r[1][i]))
        out[f"{name}_rel_err_d{n}"] = float(err)
print(json.dumps(out))
EOF

step trainer_0.5b 240 python benchmarks/trainer.py --preset qwen2.5-0.5b --dtype bfloat16 --skip-recompute \
  --repeats 3 --profile "$OUT/profile_0.5b"
step trainer_0.5b_dense 120 python benchmarks/trainer.py --preset qwen2.5-0.5b --dtype bfloat16 --skip-recompute \
  --skip-hf --attention dense --repeats 2
# No remat first (benchmarks/trainer_memory.py: at most 72 GiB of residuals next to 28 GiB of params, grads and
# AdamW state); if that does not fit, keep only the projections' outputs (at most 24 GiB of residuals).
step trainer_1.5b 180 python benchmarks/trainer.py --preset qwen2.5-1.5b --dtype bfloat16 --skip-recompute --repeats 2 ||
  step trainer_1.5b_remat_dots 180 python benchmarks/trainer.py --preset qwen2.5-1.5b --dtype bfloat16 \
    --skip-recompute --remat dots --repeats 2
step trainer_0.5b_mbt65536_remat 120 python benchmarks/trainer.py --preset qwen2.5-0.5b --dtype bfloat16 \
  --micro-batch-tokens 65536 --remat full --skip-recompute --skip-hf --repeats 2
step trainer_0.5b_traj32k 120 python benchmarks/trainer.py --preset qwen2.5-0.5b --dtype bfloat16 \
  --trajectory-len 32768 --micro-batch-tokens 32768 --remat full --skip-recompute --skip-hf --repeats 2
rm -rf "$OUT/xla-cache"
