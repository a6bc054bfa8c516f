"""RolloutConfig: the `rollout` section of a job's config (generation, admission and advantages).

The sampler engine and loop read the generation knobs (num_slots, max_len, on_update, decode_steps,
kv_cache, ...); the RolloutController (system/controller.py) reads the sampling, staleness (eta) and
advantage knobs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from areal_jax.knobs import Section, knob, require
from areal_jax.rl.advantages import GROUP_MODES

STANDBY_LEN = 512  # standby_len where the longest prompt is not known (capped at max_len); the rows' cache is R x this


def default_buckets(max_len: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Powers of two from ``min_bucket`` below ``max_len``, then ``max_len`` itself."""
    buckets, b = [], min(min_bucket, max_len)
    while b < max_len:
        buckets.append(b)
        b *= 2
    buckets.append(max_len)
    return tuple(buckets)


def prompt_bucket(max_len: int, length: int, min_bucket: int = 16) -> int:
    """The default prefill bucket (``default_buckets``) that holds a prompt of ``length`` tokens."""
    return next(b for b in default_buckets(max_len, min_bucket) if b >= min(int(length), max_len))


def default_standby_rows(num_slots: int, decode_steps: int) -> int:
    """Standby rows a sampler gets unless told: half its slots when a slot can finish inside a dispatch
    (k > 1), else 0."""
    return int(num_slots) // 2 if decode_steps > 1 else 0


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """Generation, admission and advantages (the config's `rollout` section). The controller reads the
    sampling, staleness and advantage knobs; the job builds the sampler engine from the rest."""

    section: ClassVar[str] = "rollout"

    group_size: int = knob(8, "samples per prompt (GRPO group)")
    max_new_tokens: int = knob(64, "completion tokens per sample at most")
    max_len: int = knob(320, "prompt + completion, per sampler slot")
    num_slots: int = knob(64, "decode slots of the sampler (sequences generated at once)")
    temperature: float = knob(1.0, "sampling temperature; 0 = greedy")
    top_k: int | None = knob(None, "keep the k most likely tokens (None: all)")
    top_p: float | None = knob(None, "nucleus sampling mass in (0, 1] (None: off)")
    on_update: str = knob("recompute", "recompute (re-prefill in-flight sequences with the new weights: "
                          "interruptible generation) | continue (keep the stale KV cache, and queued prompts' "
                          "prefixes)",
                          choices=("recompute", "continue"))
    decode_steps: int = knob(4, "decode steps per sampler dispatch (one jitted loop of k trips); bounds the latency an "
                             "admission or a weight update adds. Accelerators: 8-32 (per-step host work dominates "
                             "there); CPU: small")
    standby_rows: int | None = knob(None, "prefilled requests that wait on the device and take a slot the step after "
                                    "it finishes, inside a dispatch (sampler/standby.py). None: num_slots // 2 when "
                                    "decode_steps > 1, else 0 (off)")
    standby_len: int | None = knob(None, "longest prompt bucket a standby row holds (longer prompts wait for a free "
                                   "slot; dense cache: the paged cache keeps staged prompts in pages); None: the "
                                   "bucket of data.max_prompt_len, so every prompt can wait in one")
    kv_cache: str = knob("dense", "dense ([slots, max_len] per slot) | paged (a pool of pages, "
                         "sampler/paged_engine.py)", choices=("dense", "paged"))
    decode_attention: str = knob("auto", "dense cache: auto (the faster of the two below, timed once at the sampler's "
                                 "shapes on GPUs, sampler/decode_choice.py; xla elsewhere) | xla (on GPUs every "
                                 "position of the cache, every step) | kernel (models/ragged_decode.py, a Pallas kernel "
                                 "that reads each row up to its own length; GPUs, and the slow Pallas interpreter on "
                                 "the CPU)", choices=("auto", "xla", "kernel"))
    paged_attention: str = knob("auto", "paged cache: auto (the faster of the two below, timed once at the sampler's "
                                "shapes on GPUs, sampler/paged_choice.py; gather on CPUs, the Mosaic kernel on TPUs) | "
                                "gather (each row's pages copied into a dense view) | kernel (a Pallas kernel reads "
                                "pages in place, each row up to its length)", choices=("auto", "gather", "kernel"))
    page_size: int = knob(16, "positions per KV page (paged)")
    kv_pages: int | None = knob(None, "pages in the pool; None = num_slots x max_len; -1 = as many as the memory "
                                "the job's plan leaves free on the device holds (system.memory; None's pool where the "
                                "device reports no memory limit); with kv_admission=optimistic and more num_slots, "
                                "memory then bounds the sequences decoded at once")
    kv_admission: str = knob("reserve", "paged: reserve (a sample is admitted when the pool holds its longest "
                             "possible length) | optimistic (when it holds its prompt and the next dispatch's "
                             "growth; running samples give pages back and resume by recompute when the pool runs "
                             "short, sampler/preempt.py)", choices=("reserve", "optimistic"))
    max_staleness: int | None = knob(4, "eta; -1 (or None in a config file) = unbounded, which then needs "
                                     "max_concurrent")
    max_concurrent: int | None = knob(None, "groups in flight at most (None: bounded by eta only)")
    filter_uniform_groups: bool = knob(False, "drop groups whose rewards are all equal (DAPO dynamic sampling)")
    retire_solved: int = knob(0, "skip a task in later epochs once this many of its groups in a row solved it in "
                              "every sample (reward >= 1; system/retire.py); 0: never")
    retire_unsolved: int = knob(0, "skip a task in later epochs once this many of its groups in a row solved it in no "
                                "sample; 0: never")
    advantage_mode: str = knob("grpo", "group advantages (rl.advantages.group_advantages): grpo (mean / std within "
                               "the group) | dr_grpo (mean only) | rloo (leave-one-out mean) | rank (centred ranks in [-1/2, 1/2]: only the "
                               "order of the rewards counts, e.g. code pass rates)", choices=GROUP_MODES)
    overlong_buffer: int = knob(0, "DAPO's overlong penalty: completions longer than max_new_tokens - overlong_buffer "
                                "lose up to overlong_penalty of reward, linearly, before the advantages (0: off)")
    overlong_penalty: float = knob(1.0, "reward lost at max_new_tokens when overlong_buffer > 0")
    feedback_turns: int = knob(0, "code tasks: attempts after the first, each after execution feedback on the task's "
                               "first cases (sampler.turns); 0 = one turn")
    feedback_cases: int = knob(1, "feedback_turns: how many of the task's first test cases the feedback runs and shows")
    feedback_template: str = knob("\n{feedback}\n", "feedback_turns: the text appended after a turn, around "
                                  "{feedback} (a chat model's end of turn, a user turn and the start of its next "
                                  "turn; its tokens stay out of the loss); \"chat\": that frame read off the "
                                  "tokenizer's chat template (data.use_chat_template)")
    param_dtype: str = knob("same", "sampler weights: same (as the trainer's) | float32 | bfloat16 (cast on device)",
                            choices=("same", "float32", "bfloat16"))

    @property
    def standby(self) -> int:
        """The standby rows the sampler gets (``standby_rows`` with None resolved)."""
        if self.standby_rows is not None:
            return int(self.standby_rows)
        return default_standby_rows(self.num_slots, self.decode_steps)

    def standby_length(self) -> int:
        """standby_len with None resolved where the longest prompt is not known (``for_prompts``): min(max_len, 512)."""
        return min(self.max_len, STANDBY_LEN) if self.standby_len is None else int(self.standby_len)

    def for_prompts(self, max_prompt_len: int) -> "RolloutConfig":
        """This section with standby_len None resolved for prompts of at most ``max_prompt_len`` tokens (the job's
        data.max_prompt_len): the prefill bucket that holds them, so that no prompt is too long to wait in a
        standby row (a longer one waits for a free slot the host knows of: about a dispatch later)."""
        if self.standby_len is not None:
            return self
        return dataclasses.replace(self, standby_len=prompt_bucket(self.max_len, max_prompt_len))

    def make_engine(self, model: Any, *, mesh: Any, config: Any) -> Any:
        """The engine this section describes, for `model` (a Transformer or its graphdef, with `config`):
        an Engine over a dense cache, or a PagedEngine (kv_cache=paged)."""
        common = dict(num_slots=self.num_slots, max_len=self.max_len, mesh=mesh, config=config,
                      standby_rows=self.standby)
        if self.kv_cache == "paged":
            from areal_jax.sampler.paged_engine import PagedEngine

            pages = None if self.kv_pages == -1 else self.kv_pages  # -1 unresolved (no plan): the default pool
            return PagedEngine(model, page_size=self.page_size, num_pages=pages, admission=self.kv_admission,
                               attention=self.paged_attention, **common)
        from areal_jax.sampler.engine import Engine

        return Engine(model, standby_len=self.standby_length(), decode_attention=self.decode_attention, **common)

    @property
    def eta(self) -> int | None:
        """The staleness bound: None when unbounded (max_staleness None or -1)."""
        return None if self.max_staleness is None or self.max_staleness < 0 else int(self.max_staleness)

    def check(self) -> None:
        k = self.key
        require(self.group_size >= 1, f"{k('group_size')}={self.group_size} must be at least 1.")
        require(self.max_new_tokens >= 1, f"{k('max_new_tokens')}={self.max_new_tokens} must be at least 1.")
        require(self.num_slots >= self.group_size,
                f"{k('num_slots')}={self.num_slots} is smaller than {k('group_size')}={self.group_size}: a whole "
                "group must fit in the sampler's slots. Raise num_slots or lower group_size.")
        require(self.decode_steps >= 1, f"{k('decode_steps')}={self.decode_steps} must be at least 1 (decode steps "
                "per sampler dispatch; 8-32 on accelerators).")
        require(self.standby_rows is None or self.standby_rows >= 0,
                f"{k('standby_rows')}={self.standby_rows} must be >= 0 (0 turns the standby off).")
        require(self.standby_len is None or 1 <= self.standby_len <= self.max_len,
                f"{k('standby_len')}={self.standby_len} must lie in [1, {k('max_len')}={self.max_len}].")
        require(self.kv_admission == "reserve" or self.kv_cache == "paged",
                f"{k('kv_admission')}={self.kv_admission} needs {k('kv_cache')}=paged (the dense cache holds every "
                "slot's longest sequence anyway).")
        require(self.kv_pages != -1 or self.kv_cache == "paged",
                f"{k('kv_pages')}=-1 sizes a page pool to the free memory: set {k('kv_cache')}=paged too.")
        require(self.decode_attention != "kernel" or self.kv_cache == "dense",
                f"{k('decode_attention')}={self.decode_attention} is the dense cache's kernel; the paged cache reads "
                f"each row up to its length already (its own kernel). Drop it or set {k('kv_cache')}=dense.")
        require(self.paged_attention == "auto" or self.kv_cache == "paged",
                f"{k('paged_attention')}={self.paged_attention} chooses the paged cache's attention; set "
                f"{k('kv_cache')}=paged, or {k('decode_attention')} for the dense cache.")
        if self.kv_cache == "paged":
            require(self.page_size >= 1, f"{k('page_size')}={self.page_size} must be at least 1.")
            per_seq = -(-self.max_len // self.page_size)
            require(self.kv_pages is None or self.kv_pages == -1 or self.kv_pages >= per_seq,
                    f"{k('kv_pages')}={self.kv_pages} cannot hold one sequence of rollout.max_len={self.max_len} "
                    f"({per_seq} pages of {self.page_size}); raise kv_pages or lower max_len.")
        require(self.temperature >= 0, f"{k('temperature')}={self.temperature} must be >= 0 (0 means greedy).")
        require(self.top_p is None or 0 < self.top_p <= 1, f"{k('top_p')}={self.top_p} must lie in (0, 1].")
        require(self.top_k is None or self.top_k >= 1, f"{k('top_k')}={self.top_k} must be at least 1.")
        require(self.max_staleness is None or self.max_staleness >= -1,
                f"{k('max_staleness')}={self.max_staleness} must be >= 0 (0 = synchronous) or -1 (unbounded).")
        require(self.eta is not None or self.max_concurrent is not None,
                "rollout.max_staleness and rollout.max_concurrent are both unset, so rollout admission would be "
                f"unbounded. Set max_staleness (eta, e.g. {k('max_staleness')}=4) or {k('max_concurrent')}.")
        require(0 <= self.overlong_buffer <= self.max_new_tokens,
                f"{k('overlong_buffer')}={self.overlong_buffer} must lie in [0, {k('max_new_tokens')}="
                f"{self.max_new_tokens}] (0 turns the overlong penalty off).")
        require(self.overlong_penalty >= 0, f"{k('overlong_penalty')}={self.overlong_penalty} must be >= 0.")
        require(self.feedback_turns >= 0 and self.feedback_cases >= 1,
                f"{k('feedback_turns')}={self.feedback_turns} must be >= 0 and {k('feedback_cases')}="
                f"{self.feedback_cases} >= 1.")
        require(self.feedback_turns == 0 or self.feedback_template == "chat" or "{feedback}" in self.feedback_template,
                f"{k('feedback_template')}={self.feedback_template!r} lacks the '{{feedback}}' placeholder (or give "
                "'chat' for the tokenizer's chat template's frame).")
        require(self.retire_solved >= 0 and self.retire_unsolved >= 0,
                f"{k('retire_solved')}={self.retire_solved} and {k('retire_unsolved')}={self.retire_unsolved} must be "
                ">= 0 (groups in a row; 0 = never retire).")
        require(self.max_concurrent is None or self.max_concurrent >= 1,
                f"{k('max_concurrent')}={self.max_concurrent} must be at least 1.")
