"""The model families with modules of their own (each with HF_CLASSES, `config_from_hf`, `config_to_hf` and
`check_hf`), which `hf_config` dispatches a config.json's model type to."""
from __future__ import annotations

from areal_jax.models import (
    apertus,
    arcee,
    bamba,
    cohere,
    cwm,
    deepseek,
    ernie,
    exaone,
    exaone3,
    falcon_h1,
    flex_olmo,
    gemma,
    glm,
    gpt_neox,
    granite4,
    helium,
    hunyuan,
    jamba,
    lfm2,
    lfm3,
    mamba_lm,
    ministral,
    ministral3,
    nanochat,
    nemotron_h,
    olmo_hybrid,
    phi,
    phimoe,
    qwen3_5,
    seed_oss,
    stablelm,
    starcoder2,
    youtu,
)

OWN_MODULES = (deepseek, ernie, exaone, hunyuan, seed_oss, arcee, qwen3_5, ministral3, phimoe, flex_olmo, lfm2,
               lfm3, olmo_hybrid, granite4, bamba, nemotron_h, falcon_h1, jamba, mamba_lm, cwm, youtu, nanochat,
               cohere, starcoder2, gpt_neox, phi, gemma, glm, helium, ministral, apertus,
               stablelm, exaone3)
