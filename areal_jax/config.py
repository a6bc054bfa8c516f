"""The one place that knows every config key, its default, and what makes a config valid.

`base_config()` is the full schema with defaults; config files (configs/*.py) start from it and
override. `validate(config)` turns mistakes into `ConfigError`s that say what was wrong and how to fix
it, and runs before anything is compiled or loaded.
"""
from __future__ import annotations

import difflib
import os
from typing import Any

import ml_collections


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent with another."""


def base_config() -> ml_collections.ConfigDict:
    """Every key the system reads, with its default. Config files override a subset."""
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/default"  # metrics, checkpoints, timeline, summary.json; an existing run resumes
    c.seed = 0  # data order, sampling noise and initialisation
    c.total_steps = 100  # trainer updates (policy versions) to run

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # HF directory: config.json + *.safetensors (+ tokenizer files)
    c.model.tokenizer_path = ""  # defaults to model.path
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"

    c.data = ml_collections.ConfigDict()
    c.data.train_path = ""  # training prompts: JSONL or Parquet with question / answer fields
    c.data.test_path = ""  # evaluation split (same layout); empty = no evaluation
    c.data.question_field = "question"
    c.data.answer_field = "answer"
    c.data.prompt_template = "Question: {question}\nAnswer:"
    c.data.use_chat_template = False
    c.data.system_prompt = ""
    c.data.max_prompt_len = 256
    c.data.on_bad_row = "error"  # error | skip
    c.data.task = "math"  # math (question / answer rows) | code (programming tasks with hidden tests)
    c.data.shuffle = True

    c.mesh = ml_collections.ConfigDict()
    c.mesh.train_devices = ml_collections.config_dict.placeholder(int)
    c.mesh.rollout_devices = ml_collections.config_dict.placeholder(int)
    c.mesh.train_fraction = ml_collections.config_dict.placeholder(float)
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.mesh.rollout_tensor = -1
    c.mesh.colocated = False  # train and rollout share every local device

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8  # samples per prompt (GRPO group)
    c.rollout.max_new_tokens = 64
    c.rollout.max_len = 320  # prompt + completion, per sampler slot
    c.rollout.num_slots = 64
    c.rollout.temperature = 1.0
    c.rollout.top_k = ml_collections.config_dict.placeholder(int)
    c.rollout.top_p = ml_collections.config_dict.placeholder(float)
    c.rollout.on_update = "recompute"  # recompute | continue
    # decode steps per sampler dispatch (one jitted while_loop); bounds the latency an admission or a weight
    # update adds. Accelerators: 8-32 (per-step host work dominates there); CPU: small.
    c.rollout.decode_steps = 4
    c.rollout.kv_cache = "dense"  # dense ([slots, max_len] per slot) | paged (a pool of pages, sampler/paged_engine.py)
    c.rollout.page_size = 16  # positions per KV page (paged)
    c.rollout.kv_pages = ml_collections.config_dict.placeholder(int)  # pages in the pool; None = num_slots x max_len
    # eta; -1 (or None in a config file) = unbounded, which then needs max_concurrent
    c.rollout.max_staleness = ml_collections.FieldReference(4, field_type=int)
    c.rollout.max_concurrent = ml_collections.config_dict.placeholder(int)  # groups in flight
    c.rollout.filter_uniform_groups = False  # DAPO dynamic sampling
    c.rollout.advantage_mode = "grpo"  # grpo | dr_grpo | rloo
    c.rollout.param_dtype = "same"  # sampler weights: same (as the trainer's) | float32 | bfloat16 (cast on device)

    c.train = ml_collections.ConfigDict()
    c.train.batch_groups = 16  # B: groups (prompts) per update
    c.train.lr = 1e-5  # Adam learning rate
    c.train.warmup_steps = 0
    c.train.schedule = "constant"  # constant | cosine
    c.train.weight_decay = 0.0
    c.train.max_grad_norm = 1.0
    c.train.loss = "decoupled"  # decoupled | ppo
    c.train.eps_clip = 0.2
    c.train.eps_clip_high = ml_collections.config_dict.placeholder(float)
    c.train.behav_weight_cap = ml_collections.config_dict.placeholder(float)
    c.train.behav_weight_mode = "mask"  # mask | clamp
    c.train.dual_clip = ml_collections.config_dict.placeholder(float)
    c.train.loss_agg = "token-mean"
    c.train.prox_mode = "recompute"  # recompute | loglinear | behav
    c.train.ppo_minibatches = 1
    c.train.micro_batch_tokens = 4096
    c.train.kl_coef = 0.0
    c.train.kl_estimator = "k3"
    c.train.entropy_coef = 0.0
    c.train.min_lr_ratio = 0.0
    c.train.logits_chunk = 512
    c.train.attention = "auto"  # auto | dense | blocked | flash (attention over packed rows in training)
    c.train.remat = "none"  # none | full | dots (per decoder layer, in the backward)

    c.lora = ml_collections.ConfigDict()  # LoRA adapters (models/lora.py); off: full fine-tuning
    c.lora.enabled = False
    c.lora.rank = 16
    c.lora.alpha = 32.0  # the update is (alpha / rank) * x @ A @ B
    c.lora.dropout = 0.0
    c.lora.targets = "all"  # q,k,v,o,gate,up,down | attn | mlp | all | re:<regex over 'layers.0.attn.q_proj'>
    c.lora.base_dtype = ""  # frozen base storage: '' (model.param_dtype) | float32 | bfloat16
    c.lora.sampler = "merged"  # merged (adapters folded into the sampler's copy at hand-off) | unmerged

    c.reward = ml_collections.ConfigDict()
    c.reward.fn = "math"  # math | exact | module:function
    c.reward.num_workers = 2
    c.reward.timeout_s = 5.0
    c.reward.memory_mb = 4096  # address-space limit per reward worker; 0 = none
    c.reward.code_mode = "all_pass"  # reward.fn=code: all_pass (1 iff every test passes) | pass_rate
    c.reward.code_case_timeout_s = 4.0  # reward.fn=code: wall-clock limit per test case
    c.reward.code_sample_timeout_s = 20.0  # reward.fn=code: limit for all cases of one sample

    c.eval = ml_collections.ConfigDict()
    c.eval.n_test = 500  # problems of data.test_path; 0 disables evaluation
    c.eval.at_start = True
    c.eval.at_end = True
    c.eval.every_steps = 0
    c.eval.max_new_tokens = 64
    c.eval.samples = 8  # sampled completions per problem (sampled pass@1, pass@k); 0 = greedy only
    c.eval.num_slots = 256  # decode slots of the evaluation's sampler (all greedy + sampled sequences in one pass)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 10
    c.checkpoint.keep = 2
    c.checkpoint.resume = True

    c.log = ml_collections.ConfigDict()
    c.log.every_steps = 1
    c.log.tensorboard = True
    c.log.timeline = True
    c.log.timeline_max_events = 1_000_000  # kept in timeline.json (spooled to disk, ~150 bytes each); later ones are counted
    c.log.console = True
    c.log.param_digests = False  # record params fingerprints per step (multi-process checks)

    c.distributed = ml_collections.ConfigDict()
    c.distributed.enabled = False  # also turned on by a coordinator address or SLURM / TPU env
    c.distributed.coordinator_address = ""
    c.distributed.num_processes = ml_collections.config_dict.placeholder(int)
    c.distributed.process_id = ml_collections.config_dict.placeholder(int)
    c.distributed.heartbeat_timeout_s = 60.0
    c.distributed.file_heartbeats = False  # also heartbeat files under <run_dir>/heartbeats (needs a shared local run_dir)
    return c


_CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "data.on_bad_row": ("error", "skip"),
    "data.task": ("math", "code"),
    "reward.code_mode": ("all_pass", "pass_rate"),
    "rollout.on_update": ("recompute", "continue"),
    "rollout.kv_cache": ("dense", "paged"),
    "rollout.advantage_mode": ("grpo", "dr_grpo", "rloo"),
    "rollout.param_dtype": ("same", "float32", "bfloat16"),
    "train.schedule": ("constant", "cosine"),
    "train.loss": ("decoupled", "ppo"),
    "train.behav_weight_mode": ("mask", "clamp"),
    "train.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "train.prox_mode": ("recompute", "loglinear", "behav"),
    "train.kl_estimator": ("k1", "k2", "k3"),
    "train.attention": ("auto", "dense", "blocked", "flash"),
    "train.remat": ("none", "full", "dots"),
    "lora.base_dtype": ("", "float32", "bfloat16"),
    "lora.sampler": ("merged", "unmerged"),
}


def config_docs() -> dict[str, str]:
    """{key: doc} for every key of base_config, read from the comments in its source (a comment on the
    key's own line, plus any comment lines just above it): the docs live in one place, beside the defaults."""
    import inspect
    import io
    import tokenize

    base = base_config()
    docs: dict[str, str] = {}
    pending: list[str] = []
    line_tokens: list[tokenize.TokenInfo] = []
    for tok in tokenize.generate_tokens(io.StringIO(inspect.getsource(base_config)).readline):
        if tok.type not in (tokenize.NEWLINE, tokenize.NL):
            line_tokens.append(tok)
            continue
        words = [t for t in line_tokens if t.type not in (tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
        comments = [t.string.lstrip("#").strip() for t in line_tokens if t.type == tokenize.COMMENT]
        line_tokens = []
        if not words:  # a comment-only (or blank) line: it documents the next key
            pending = pending + comments if comments else []
            continue
        eq = next((i for i, t in enumerate(words) if t.string == "="), None)
        lhs = "".join(t.string for t in words[:eq]) if eq else ""
        if lhs.startswith("c.") and not isinstance(_lookup(base, lhs[2:]), ml_collections.ConfigDict):
            docs[lhs[2:]] = "; ".join(pending + comments)
        pending = []
    return docs


def _lookup(c: Any, key: str) -> Any:
    for part in key.split("."):
        c = c[part]
    return c


def config_help(config: ml_collections.ConfigDict | None = None) -> str:
    """Every key with its value (the defaults, or `config`'s) and its doc, one line each, in the order
    of base_config."""
    docs = config_docs()
    flat = _flatten(config if config is not None else base_config())
    lines = []
    for key in list(docs) + [k for k in flat if k not in docs]:
        head = f"{key}={flat.get(key)!r}"
        doc = docs.get(key, "")
        lines.append(f"  --config.{head:<40} {doc}".rstrip())
    return "\n".join(lines)


def _flatten(c: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in c.items():
        key = f"{prefix}{k}"
        if isinstance(v, ml_collections.ConfigDict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _check_keys(config: ml_collections.ConfigDict) -> None:
    known = _flatten(base_config())
    for key in _flatten(config):
        if key in known:
            continue
        close = difflib.get_close_matches(key, list(known), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"Unknown config key '{key}'.{hint} `python -m areal_jax.main --config.help` lists every key.")


def check_override_flags(argv: list[str]) -> None:
    """Raise ConfigError for a `--config.x.y=value` command-line override naming an unknown key.

    Runs before flag parsing, whose own error for this case is a stack of KeyError / AttributeError.
    """
    known = _flatten(base_config())
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config."):].split("=", 1)[0]
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f" Did you mean '--config.{close[0]}'?" if close else ""
            raise ConfigError(f"Unknown config key in the override '{arg}'.{hint} "
                              "`python -m areal_jax.main --config.help` lists every key.")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_code_task(config: ml_collections.ConfigDict) -> None:
    """data.task=code and reward.fn=code go together; the code time limits fit inside reward.timeout_s."""
    task, fn, rw = config.data.task, config.reward.fn, config.reward
    _require(not (task == "code" and fn in ("math", "exact")),
             f"--config.data.task=code gives hidden tests as answers, which reward.fn={fn!r} cannot score; pass "
             "--config.reward.fn=code.")
    _require(not (fn == "code" and task != "code"),
             "--config.reward.fn=code needs programming tasks with tests; pass --config.data.task=code.")
    if fn == "code":
        _require(rw.code_case_timeout_s > 0 and rw.code_sample_timeout_s > 0,
                 "--config.reward.code_case_timeout_s and --config.reward.code_sample_timeout_s must be positive.")
        _require(rw.timeout_s > rw.code_sample_timeout_s,
                 f"--config.reward.timeout_s={rw.timeout_s} must exceed --config.reward.code_sample_timeout_s="
                 f"{rw.code_sample_timeout_s} (the pool kills a sample at timeout_s, before its tests can finish).")


def max_staleness(config: ml_collections.ConfigDict) -> int | None:
    """eta from the config: None when unbounded (rollout.max_staleness None or -1)."""
    eta = config.rollout.max_staleness
    return None if eta is None or eta < 0 else int(eta)


def validate(config: ml_collections.ConfigDict, *, check_paths: bool = True) -> ml_collections.ConfigDict:
    """Raise ConfigError on the first problem found; return the config unchanged when valid.

    Checks that need only the config run here (keys, types, ranges, relations between values);
    device-count checks run in system.mesh once devices are known, still before any compile.
    """
    _check_keys(config)
    flat = _flatten(config)
    for key, choices in _CHOICES.items():
        _require(flat[key] in choices, f"{key}={flat[key]!r} is not one of {', '.join(choices)}.")

    r, t = config.rollout, config.train
    _require(config.total_steps >= 1, f"total_steps={config.total_steps} must be at least 1.")
    _require(r.group_size >= 1, f"rollout.group_size={r.group_size} must be at least 1.")
    _require(t.batch_groups >= 1, f"train.batch_groups={t.batch_groups} must be at least 1.")
    _require(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be at least 1.")
    _require(
        config.data.max_prompt_len + r.max_new_tokens <= r.max_len,
        f"data.max_prompt_len ({config.data.max_prompt_len}) + rollout.max_new_tokens "
        f"({r.max_new_tokens}) exceeds rollout.max_len ({r.max_len}); raise rollout.max_len or lower one of them.",
    )
    _require(
        r.num_slots >= r.group_size,
        f"rollout.num_slots={r.num_slots} is smaller than rollout.group_size={r.group_size}: a whole "
        "group must fit in the sampler's slots. Raise num_slots or lower group_size.",
    )
    _require(r.get("decode_steps", 1) >= 1, f"--config.rollout.decode_steps={r.get('decode_steps')} must be at "
             "least 1 (decode steps per sampler dispatch; 8-32 on accelerators).")
    if r.get("kv_cache", "dense") == "paged":
        _require(r.page_size >= 1, f"--config.rollout.page_size={r.page_size} must be at least 1.")
        per_seq = -(-r.max_len // max(1, r.page_size))
        _require(r.kv_pages is None or r.kv_pages >= per_seq,
                 f"--config.rollout.kv_pages={r.kv_pages} cannot hold one sequence of rollout.max_len={r.max_len} "
                 f"({per_seq} pages of {r.page_size}); raise kv_pages or lower max_len.")
    _require(r.temperature >= 0, f"rollout.temperature={r.temperature} must be >= 0 (0 means greedy).")
    if r.top_p is not None:
        _require(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must lie in (0, 1].")
    if r.top_k is not None:
        _require(r.top_k >= 1, f"rollout.top_k={r.top_k} must be at least 1.")
    if r.max_staleness is not None:
        _require(r.max_staleness >= -1, f"rollout.max_staleness={r.max_staleness} must be >= 0 (0 = synchronous) "
                 "or -1 (unbounded).")
    _require(
        max_staleness(config) is not None or r.max_concurrent is not None,
        "rollout.max_staleness and rollout.max_concurrent are both unset, so rollout admission would be "
        "unbounded. Set max_staleness (eta) or max_concurrent.",
    )
    if r.max_concurrent is not None:
        _require(r.max_concurrent >= 1, f"rollout.max_concurrent={r.max_concurrent} must be at least 1.")
    _require(t.lr > 0, f"train.lr={t.lr} must be positive.")
    _require(t.eps_clip > 0, f"train.eps_clip={t.eps_clip} must be positive.")
    if t.dual_clip is not None:
        _require(t.dual_clip > 1, f"train.dual_clip={t.dual_clip} must be greater than 1.")
    if t.behav_weight_cap is not None:
        _require(t.behav_weight_cap > 0, f"train.behav_weight_cap={t.behav_weight_cap} must be positive.")
    _require(t.ppo_minibatches >= 1, f"train.ppo_minibatches={t.ppo_minibatches} must be at least 1.")
    _require(
        t.batch_groups % t.ppo_minibatches == 0,
        f"train.batch_groups={t.batch_groups} is not divisible by train.ppo_minibatches={t.ppo_minibatches}.",
    )
    _require(
        t.micro_batch_tokens >= r.max_len,
        f"train.micro_batch_tokens={t.micro_batch_tokens} is smaller than rollout.max_len={r.max_len}: the "
        "longest sequence must fit one micro-batch.",
    )
    _require(config.reward.timeout_s > 0, f"reward.timeout_s={config.reward.timeout_s} must be positive.")
    _require(config.reward.num_workers >= 1, f"reward.num_workers={config.reward.num_workers} must be >= 1.")
    _check_code_task(config)
    _require(config.eval.get("samples", 8) >= 0,
             f"--config.eval.samples={config.eval.get('samples')} must be >= 0 (0 = greedy pass@1 only).")
    _require(config.eval.get("num_slots", 256) >= 1,
             f"--config.eval.num_slots={config.eval.get('num_slots')} must be at least 1.")
    _require(config.checkpoint.every_steps >= 0, "checkpoint.every_steps must be >= 0 (0 = only at the end).")
    _require(config.log.timeline_max_events >= 1,
             f"log.timeline_max_events={config.log.timeline_max_events} must be >= 1 (set log.timeline=False to "
             "record no timeline).")
    _require(config.distributed.heartbeat_timeout_s >= 1,
             f"distributed.heartbeat_timeout_s={config.distributed.heartbeat_timeout_s} must be at least 1 (seconds "
             "without a heartbeat before a process counts as dead), e.g. --config.distributed.heartbeat_timeout_s=60.")
    from areal_jax import paths

    try:
        run_dir = paths.run_path(config.run_dir)
        paths.checkpoint_directory(run_dir)
    except ValueError as e:
        raise ConfigError(f"run_dir: {e}") from None
    _require(not config.distributed.file_heartbeats or paths.is_local(run_dir),
             f"distributed.file_heartbeats needs a local run_dir that every process sees, not {config.run_dir!r}; "
             "peers are detected without it (--config.distributed.file_heartbeats=False).")
    if config.lora.enabled:
        from areal_jax.system.build import lora_config  # noqa: PLC0415

        try:
            lora_config(config)
        except ValueError as err:
            raise ConfigError(f"--config.{err}") from err  # each message starts with the key, e.g. "lora.rank=0 ..."
    m = config.mesh
    if m.train_fraction is not None:
        _require(0 < m.train_fraction < 1, f"mesh.train_fraction={m.train_fraction} must lie in (0, 1).")
        _require(
            m.train_devices is None and m.rollout_devices is None,
            "Set either mesh.train_fraction or mesh.train_devices / mesh.rollout_devices, not both.",
        )
    if check_paths:
        try:
            paths.check_backend(config.run_dir)  # the object store's client package is installed
        except ValueError as e:
            raise ConfigError(f"--config.run_dir: {e}") from None
        _require(bool(config.model.path), "model.path is empty: point it at an HF checkpoint directory.")
        _require(
            os.path.isdir(config.model.path),
            f"model.path={config.model.path!r} is not a directory. Point it at an HF checkpoint directory "
            "(config.json + model.safetensors).",
        )
        _require(bool(config.data.train_path), "data.train_path is empty: point it at a JSONL or Parquet file.")
        for key in ("data.train_path", "data.test_path"):
            path = flat[key]
            if path:
                _require(os.path.exists(path), f"{key}={path!r} does not exist.")
        if config.eval.n_test > 0 and (config.eval.at_start or config.eval.at_end or config.eval.every_steps):
            _require(bool(config.data.test_path), "eval is on but data.test_path is empty; set it or eval.n_test=0.")
    return config
