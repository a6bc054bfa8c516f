"""HF transformers `generate` on the sampler benchmark's workload (benchmarks/sampler.py's row (c)): PyTorch on the
device JAX runs on, the same dtype, batch and forced lengths."""
from __future__ import annotations

import time

import jax


def run_hf(args, cfg, path: str | None, prompts, lengths, batch: int) -> tuple[float, int, str]:
    """(seconds, tokens, device) of HF generate; random weights of the same shape when there is no checkpoint."""
    import torch
    import transformers

    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    if path is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        fields = cfg.to_hf_dict()  # the same architecture and shape (Qwen2, Gemma 3, ...)
        fields.pop("architectures")
        hf_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None

    def generate(chunk_prompts, max_new):
        width = max(len(p) for p in chunk_prompts)
        ids = torch.zeros((len(chunk_prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk_prompts):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
        assert out.shape[1] == width + max_new
        if device == "cuda":
            torch.cuda.synchronize()

    generate(prompts[:2], 2)  # warm-up
    n = len(prompts) if args.hf_prompts is None else min(args.hf_prompts, len(prompts))
    t = time.perf_counter()
    for start in range(0, n, batch):
        generate(prompts[start : min(n, start + batch)], max(lengths[start : min(n, start + batch)]))
    return time.perf_counter() - t, sum(lengths[:n]), device
