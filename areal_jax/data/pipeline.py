"""The prompt stream: a grain MapDataset over tokenized prompts, sharded, shuffled per epoch, repeated.

    source = load_prompt_source("train.jsonl", tokenizer, max_prompt_len=512)
    prompts = PromptIterator(source, seed=0)            # shard = (jax.process_index(), process_count())
    example = next(prompts)                             # PromptExample(uid, prompt_tokens, answer, question)
    state = prompts.get_state()                         # JSON-serialisable; set_state(state) resumes exactly

Order of operations: the loaded rows are sharded by process (row i goes to process i % process_count),
then each shard is shuffled with a per-epoch seed and repeated. Data lives in memory, so grain reads it
in the calling thread (no worker processes or threads).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from typing import Any, ClassVar, Sequence

import grain

from areal_jax.data.prompts import DEFAULT_PROMPT_TEMPLATE, PromptExample, PromptFormat, tokenize_records
from areal_jax.data.readers import read_records
from areal_jax.knobs import Section, knob, require
from areal_jax.tokenizer import Tokenizer

__all__ = ["PromptSource", "PromptIterator", "load_prompt_source", "make_prompt_iterator", "load_eval_split"]

_STATE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class _Item:
    key: str  # "<file name>:<row>"
    prompt_tokens: tuple[int, ...]
    answer: str
    question: str


@dataclasses.dataclass
class PromptSource:
    """Loaded, validated and tokenized prompts: a random-access source for grain (len / getitem)."""
    items: list[_Item]
    num_bad_rows_skipped: int = 0
    num_too_long_skipped: int = 0
    bad_row_messages: list[str] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> _Item:
        return self.items[index]


def load_prompt_source(paths: str | Sequence[str], tokenizer: Tokenizer, *, question_field: str = "auto",
                       answer_field: str = "answer", answer_format: str = "auto", on_bad_row: str = "error",
                       prompt_template: str = DEFAULT_PROMPT_TEMPLATE, use_chat_template: bool = False,
                       system_prompt: str | None = None, max_prompt_len: int | None = None,
                       on_too_long: str = "skip", add_special_tokens: bool = True, task: str = "math") -> PromptSource:
    """Reads .jsonl / .parquet files, formats and tokenizes every prompt, drops the unusable ones.

    See readers.read_records for the row checks and prompts.PromptFormat for the formatting options.
    task "code" reads programming tasks instead (code_readers.read_code_records: the answer is the hidden
    tests as JSON; answer_field and answer_format are unused). Raises ValueError when nothing usable is left.
    """
    if task == "code":
        from areal_jax.data.code_readers import read_code_records

        records, stats = read_code_records(paths, question_field=question_field, on_bad_row=on_bad_row)
    elif task == "math":
        records, stats = read_records(paths, question_field=question_field, answer_field=answer_field,
                                      answer_format=answer_format, on_bad_row=on_bad_row)
    else:
        raise ValueError(f"task={task!r} is not one of math, code; pass --config.data.task=math or code.")
    prompt_format = PromptFormat(template=prompt_template, use_chat_template=use_chat_template,
                                 system_prompt=system_prompt, add_special_tokens=add_special_tokens)
    kept, too_long = tokenize_records(records, tokenizer, prompt_format, max_prompt_len, on_too_long)
    if not kept:
        raise ValueError(f"Every prompt of {paths} is longer than max_prompt_len={max_prompt_len} tokens "
                         f"({too_long} skipped); raise max_prompt_len.")
    items = [_Item(key=f"{os.path.basename(r.source)}:{r.row}", prompt_tokens=tuple(tokens),
                   answer=r.answer, question=r.question) for r, tokens in kept]
    return PromptSource(items=items, num_bad_rows_skipped=stats.bad_rows_skipped,
                        num_too_long_skipped=too_long, bad_row_messages=list(stats.bad_row_messages))


def _default_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"Need 0 <= process_index < process_count, got {process_index} and {process_count}.")
    return process_index, process_count


def _mix_seed(seed: int, source: int = 0) -> int:
    """A 32-bit shuffle seed from the user's seed, so that seed s+1 is not seed s one epoch later (source: the
    index of a source of a weighted mixture after the first, each shuffled apart)."""
    text = f"prompt-shuffle/{int(seed)}" + (f"/source{source}" if source else "")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _to_example(shard_size: int, index: int, item: _Item) -> PromptExample:
    """The index-th draw of a repeated shard of shard_size items: its uid carries the epoch it belongs to."""
    return PromptExample(uid=f"{item.key}:{index // shard_size}", prompt_tokens=list(item.prompt_tokens),
                         answer=item.answer, question=item.question)


def _shard_items(source: PromptSource, process_index: int, process_count: int) -> list[_Item]:
    shard = source.items[process_index::process_count]
    if not shard:
        raise ValueError(f"Process {process_index} of {process_count} gets no prompts: the dataset has only "
                         f"{len(source)} usable rows. Use a larger dataset or fewer processes.")
    return shard


class PromptIterator:
    """An endless (or ``num_epochs``-long) stream of PromptExample for this process's shard.

    Within an epoch every prompt of the shard appears once, in an order fixed by (seed, epoch); uids
    are "<file name>:<row>:<epoch>". ``get_state`` / ``set_state`` checkpoint the position.

    weights (one per source of a list of sources, data.sources): each source is sharded, shuffled and repeated
    on its own (its own epochs), and the stream interleaves them in these proportions (grain's mix: deterministic,
    each source's share of every prefix stays close to its weight). Without weights, a list of sources is one
    dataset (every row of every source once per epoch).
    """

    def __init__(self, source: PromptSource | Sequence[PromptSource], *, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = None, process_index: int | None = None,
                 process_count: int | None = None, weights: Sequence[float] | None = None) -> None:
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be a positive count or None (endless), got {num_epochs}.")
        sources = list(source) if isinstance(source, (list, tuple)) else [source]
        if weights is not None and len(weights) != len(sources):
            raise ValueError(f"{len(weights)} weights for {len(sources)} prompt sources: give one per source.")
        if weights is None and len(sources) > 1:
            sources = [PromptSource(items=[i for s in sources for i in s.items],
                                    num_bad_rows_skipped=sum(s.num_bad_rows_skipped for s in sources),
                                    num_too_long_skipped=sum(s.num_too_long_skipped for s in sources))]
        self.source = sources[0] if len(sources) == 1 else sources
        self.seed = int(seed)
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.process_index, self.process_count = _default_process(process_index, process_count)
        shards = [_shard_items(s, self.process_index, self.process_count) for s in sources]
        self.shard_sizes = [len(shard) for shard in shards]
        self.shard_size = sum(self.shard_sizes)
        # Draws in which every source goes through all of its rows (a source of share w needs size / w draws): a run
        # of that many retired draws means every task is retired (the controller then starts retirement over).
        shares = [1.0] if weights is None or len(shards) == 1 else [w / sum(weights) for w in weights]
        self.pass_draws = max(math.ceil(n / w) for n, w in zip(self.shard_sizes, shares)) if len(shards) > 1 \
            else self.shard_size
        datasets = []
        for i, shard in enumerate(shards):
            dataset = grain.MapDataset.source(shard)
            if shuffle:  # source 0 keeps the one-source seed, so a single file's order does not change
                dataset = dataset.shuffle(seed=_mix_seed(self.seed) if i == 0 else _mix_seed(self.seed, i))
            datasets.append(dataset.repeat(num_epochs).map_with_index(functools.partial(_to_example, len(shard))))
        dataset = datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, list(map(float, weights)))
        self._dataset = dataset
        self._iterator = dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)).__iter__()
        digest = hashlib.sha256()
        for shard in shards:
            for item in shard:
                digest.update(json.dumps([item.key, item.prompt_tokens, item.answer]).encode())
        self._fingerprint = {"seed": self.seed, "shuffle": shuffle, "num_epochs": num_epochs,
                             "process_index": self.process_index, "process_count": self.process_count,
                             "shard_size": self.shard_size, "content_sha256": digest.hexdigest()[:16]}
        if len(shards) > 1:
            self._fingerprint.update(shard_sizes=self.shard_sizes, weights=[float(w) for w in weights])

    def __iter__(self) -> "PromptIterator":
        return self

    def __next__(self) -> PromptExample:
        return next(self._iterator)

    def take(self, n: int) -> list[PromptExample]:
        """The next ``n`` examples (fewer if a finite stream ends)."""
        out = []
        for _ in range(n):
            try:
                out.append(next(self))
            except StopIteration:
                break
        return out

    @property
    def next_index(self) -> int:
        """How many examples this iterator has yielded since the start of epoch 0."""
        return int(self._iterator.get_state()["next_index"])

    @property
    def epoch(self) -> int:
        """The epoch of the next example (one dataset; a weighted mixture's sources each count their own)."""
        if len(self.shard_sizes) > 1:
            raise ValueError("a weighted mixture has no single epoch: each source counts its own (in the uids).")
        return self.next_index // self.shard_size

    @property
    def num_bad_rows_skipped(self) -> int:
        sources = self.source if isinstance(self.source, list) else [self.source]
        return sum(s.num_bad_rows_skipped for s in sources)

    @property
    def num_too_long_skipped(self) -> int:
        sources = self.source if isinstance(self.source, list) else [self.source]
        return sum(s.num_too_long_skipped for s in sources)

    def get_state(self) -> dict[str, Any]:
        """The position plus a fingerprint of the configuration; JSON-serialisable."""
        return {"format": _STATE_FORMAT, "grain": self._iterator.get_state(), **self._fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes from ``get_state()`` output; the next example is the one that would have come next.

        Raises ValueError when the state was taken from a differently configured stream (other data,
        seed, shuffle, epochs or process shard), since resuming it would silently change the order.
        """
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT or "grain" not in state:
            raise ValueError(f"Not a prompt iterator state (expected the dict from get_state()): {state!r:.200}")
        differs = {k: (state.get(k), v) for k, v in self._fingerprint.items() if state.get(k) != v}
        if differs:
            details = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differs.items())
            raise ValueError(f"The saved prompt-iterator state belongs to a different data stream ({details}). "
                             f"Resume with the same data files, prompt options, seed and process layout.")
        self._iterator.set_state(state["grain"])


def make_prompt_iterator(paths: str | Sequence[str], tokenizer: Tokenizer, *, seed: int = 0, shuffle: bool = True,
                         num_epochs: int | None = None, process_index: int | None = None,
                         process_count: int | None = None, **load_options: Any) -> PromptIterator:
    """load_prompt_source(paths, tokenizer, **load_options) wrapped in a PromptIterator."""
    source = load_prompt_source(paths, tokenizer, **load_options)
    return PromptIterator(source, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
                          process_index=process_index, process_count=process_count)


def load_eval_split(paths: str | Sequence[str], tokenizer: Tokenizer, *, limit: int | None = None,
                    process_index: int = 0, process_count: int = 1, **load_options: Any) -> list[PromptExample]:
    """Every usable prompt of an evaluation file in file order (no shuffle, no repeat), epoch 0.

    limit keeps the first ``limit`` prompts (before sharding); process_index / process_count take
    every process_count-th prompt, for evaluation split across processes. ``load_options`` are those
    of load_prompt_source (field names, prompt template, max_prompt_len, on_bad_row, ...).
    """
    source = load_prompt_source(paths, tokenizer, **load_options)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be a positive number of prompts or None, got {limit}.")
        source = dataclasses.replace(source, items=source.items[:limit])
    process_index, process_count = _default_process(process_index, process_count)
    shard = _shard_items(source, process_index, process_count)
    return [PromptExample(uid=f"{item.key}:0", prompt_tokens=list(item.prompt_tokens), answer=item.answer,
                          question=item.question) for item in shard]


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """Where the prompts come from and how they are formatted (the config's `data` section)."""

    section: ClassVar[str] = "data"

    train_path: str = knob("", "training prompts: JSONL or Parquet with question / answer fields; several as "
                               "NAME=PATH,NAME=PATH (data.sources)")
    train_weights: str = knob("", "with several train_path files: their sampling proportions, e.g. 0.3,0.7 (each "
                                  "file shuffled and repeated on its own); empty = one dataset of all their rows")
    test_path: str = knob("", "evaluation split (same layout); several as NAME=PATH,NAME=PATH (each scored apart "
                              "and pooled, evaluation.sets); empty = no evaluation")
    question_field: str = knob("auto", "field of a row holding the question; auto: math rows take question / "
                               "problem / prompt, code rows their layout's statement field")
    answer_field: str = knob("answer", "field of a row holding the reference answer (code: the hidden tests)")
    prompt_template: str = knob(DEFAULT_PROMPT_TEMPLATE, "prompt text around {question}")
    use_chat_template: bool = knob(False, "wrap the prompt in the tokenizer's chat template")
    system_prompt: str = knob("", "system message of the chat template")
    chat_template_vars: str = knob("", "extra variables of the chat template, a JSON object, e.g. "
                                   "'{\"enable_thinking\": false}' (Qwen3: no reasoning block)")
    max_prompt_len: int = knob(256, "prompt tokens at most; longer prompts are skipped")
    on_bad_row: str = knob("error", "a malformed row stops the run (error) or is counted and skipped (skip)",
                           choices=("error", "skip"))
    task: str = knob("math", "math (question / answer rows) | code (programming tasks with hidden tests)",
                     choices=("math", "code"))
    train_tasks: str = knob("", "with several train_path files: each one's task, e.g. math,code (reward.fn=mixed "
                                "scores each row by its task); empty = data.task for every file")
    task_overrides: str = knob("", "data keys that differ for one task's files in a mixed run, a JSON object, e.g. "
                                   "'{\"code\": {\"system_prompt\": \"Answer in one python block.\"}}' (keys: "
                                   "question_field, answer_field, prompt_template, system_prompt, max_prompt_len)")
    file_overrides: str = knob("", "data keys that differ for one file of train_path or test_path (its NAME in "
                                   "NAME=PATH, else the file's stem), a JSON object as task_overrides, e.g. "
                                   "'{\"math500\": {\"question_field\": \"problem\"}}'; applied after task_overrides")
    test_tasks: str = knob("", "with several test_path sets: each one's task, as train_tasks; empty = data.task")
    shuffle: bool = knob(True, "shuffle the prompts (seeded by the job's seed)")

    @property
    def template_variables(self) -> dict:
        """chat_template_vars as a dict ({} when empty)."""
        return json.loads(self.chat_template_vars) if self.chat_template_vars.strip() else {}

    def check(self) -> None:
        require(self.max_prompt_len >= 1, f"{self.key('max_prompt_len')}={self.max_prompt_len} must be at least 1.")
        from areal_jax.data.sources import files_as_read, parse_named_paths, parse_weights

        try:  # the lists of files, their weights, tasks and overrides (their existence: config._check_paths)
            parse_weights(self.train_weights, len(parse_named_paths(self.train_path, "data.train_path")))
            files_as_read(self)
        except ValueError as e:
            require(False, str(e))
        if self.chat_template_vars.strip():
            try:
                variables = json.loads(self.chat_template_vars)
            except json.JSONDecodeError as e:
                variables = e
            require(isinstance(variables, dict),
                    f"{self.key('chat_template_vars')}={self.chat_template_vars!r} must be a JSON object of the "
                    "template's variables, e.g. '{\"enable_thinking\": false}'.")
            require(self.use_chat_template, f"{self.key('chat_template_vars')} sets variables of the chat template, "
                    f"which is off: pass {self.key('use_chat_template')}=True.")
