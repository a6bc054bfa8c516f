"""Multi-turn rollouts with execution feedback (``rollout.feedback_turns`` > 0, code tasks).

A sample's first turn is generated as usual. Unless it ended at its budget, its program then runs on the task's
first (visible) cases (``rewards.code_feedback``, in this process's threads, each run in the sandbox); if a case
fails, the feedback text, wrapped in ``rollout.feedback_template``, is appended and the sample goes back to the
sampler as a continuation: prompt + everything so far + feedback, for the rest of its token budget. After
``feedback_turns`` extra turns, or once the shown cases pass, the sample is final: its completion is every turn and
every feedback in order, the feedback tokens masked out of the loss (``Completion.loss_mask`` 0, behaviour
log-probability 0), and its reward scores the last turn's program against all hidden tests as before.

Each token keeps the version that generated it, so staleness and the decoupled objective treat the turns of one
sample like the chunks of an interrupted generation. Evaluations can run the same turns (eval.feedback_turns,
`evaluate --feedback_turns`): they then report pass@1 of the first attempts and of the last.

Credit (``turn_advantages``): a sample's final reward must not teach its wrong first attempt, and a repair must not be
judged against siblings that needed none. So first attempts are judged among themselves, each by its own outcome (a
first attempt that needed feedback failed a shown case: 0; one that did not is the sample's reward), and repairs among
themselves: the later turns of a sample by its final reward against those of the group's other multi-turn samples.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import time
from typing import Callable, Hashable

import numpy as np

from areal_jax.rl.advantages import group_advantages
from areal_jax.sampler.requests import Completion, Request

__all__ = ["CHAT_TEMPLATE", "FeedbackTurns", "attempt_tokens", "chat_feedback_template", "continuation_id",
           "repair_turn_notes", "resolve_feedback_template", "turn_advantages"]

# rollout.feedback_template = "chat": the frame comes from the tokenizer's chat template (chat_feedback_template).
CHAT_TEMPLATE = "chat"

Key = tuple[Hashable, int]  # (group id, sample index)
TURN = "turn"


def chat_feedback_template(tokenizer) -> str:
    """The feedback template of ``tokenizer``'s chat template: what the template renders between an assistant turn's
    content and the next assistant turn's content when a user turn holding the feedback comes between them, less the
    stop token that ended the assistant turn (the sampler has already put it in the sequence). For ChatML (Qwen):
    "\\n<|im_start|>user\\n{feedback}<|im_end|>\\n<|im_start|>assistant\\n". Raises ValueError, saying what to
    give instead, when the tokenizer has no chat template or its frame cannot be read off this way."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("feedback_template='chat' frames the feedback with the tokenizer's chat template, but this "
                         "tokenizer has none: write the frame out, e.g. feedback_template='\\nFeedback: {feedback}\\n'.")
    question, answer, feedback = "qz7question", "qz7answer", "qz7feedback"
    asked = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=False)
    both = tokenizer.apply_chat_template(asked + [{"role": "assistant", "content": answer},
                                                  {"role": "user", "content": feedback}],
                                         add_generation_prompt=True, tokenize=False)
    # The rollout's sequence is the prompt as sampled, the turn as generated, then the frame: the template must render
    # the continued conversation as that prompt, the turn's text (after any whitespace the model writes itself) and
    # the rest. How it renders a final assistant turn (some add an empty reasoning block there) does not matter.
    start = both.find(answer, len(prompt)) if both.startswith(prompt) else -1
    if start < 0 or both[len(prompt):start].strip() or both.count(answer) != 1 or both.count(feedback) != 1:
        raise ValueError("feedback_template='chat': the chat template does not render an assistant turn followed by a "
                         "user turn as the prompt it gave continued; write the frame out in feedback_template (with "
                         "{feedback}).")
    after = both[start + len(answer):]
    stops = [tokenizer.convert_ids_to_tokens([i])[0] for i in tokenizer.eos_token_ids]
    stop = next((t for t in stops if t and after.startswith(t)), None)
    if stop is None:
        raise ValueError(f"feedback_template='chat': the chat template ends an assistant turn with {after[:24]!r}, "
                         f"which starts with none of the tokenizer's stop tokens {stops}, so a sampled turn would not "
                         "end where the template expects; write the frame out in feedback_template (with {feedback}) "
                         "or add the turn's end token to the stop tokens (generation_config.json eos_token_id).")
    frame = after[len(stop):].replace("{", "{{").replace("}", "}}")
    return frame.replace(feedback, "{feedback}")


def resolve_feedback_template(template: str, tokenizer) -> str:
    """rollout.feedback_template as the text to format: ``chat_feedback_template`` for "chat", else as given."""
    return chat_feedback_template(tokenizer) if template == CHAT_TEMPLATE else template


def repair_turn_notes(config, tokenizer) -> list[str]:
    """What a job with repair turns logs at start: the frame read off the chat template (feedback_template="chat";
    ValueError when it cannot be read) and a note when the token-mean loss lets failed repairs dominate."""
    r, notes = config.rollout, []
    if r.feedback_turns > 0 and config.train.loss_agg == "token-mean":
        notes.append("Note: repair turns with train.loss_agg=token-mean: long failed repairs outweigh short passing "
                     "ones and degenerated the repair turn in 2 of 3 measured runs (README, Repair turns); "
                     "--config.train.loss_agg=seq-mean-token-mean weighs each sequence equally.")
    if r.feedback_template == CHAT_TEMPLATE and max(r.feedback_turns, config.eval.feedback_turns) > 0:
        notes.append(f"Repair turns: feedback framed as {chat_feedback_template(tokenizer)!r} (the chat template's).")
    return notes


def continuation_id(request_id: Hashable) -> Key | None:
    """(group id, sample index) of a continuation request's id, None for a group's own request."""
    if isinstance(request_id, tuple) and len(request_id) == 4 and request_id[0] == TURN:
        return request_id[1], request_id[2]
    return None


@dataclasses.dataclass
class _Sample:
    prompt: list[int]
    answer: str
    segments: list[tuple[bool, np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    last: Completion | None = None  # the last model turn
    # record_routes: the experts of each position, each turn adding those it computed first (its feedback's, from its
    # prefill; its tokens', from its decode steps); None once a turn came without them
    routes: list[np.ndarray] | None = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> int:
        return sum(len(tokens) for _, tokens, _, _ in self.segments)

    @property
    def turns(self) -> int:
        return sum(1 for is_model, *_ in self.segments if is_model)


class FeedbackTurns:
    """The turns of every sample in flight (see the module doc).

    Args:
      turns: extra turns after the first (rollout.feedback_turns).
      template: text around the feedback, with "{feedback}" (rollout.feedback_template).
      encode: text -> token ids (no special tokens added).
      decode: token ids -> text (what the feedback runs).
      feedback: (completion text, answer) -> (passed, feedback text): ``rewards.code_feedback`` with its limits bound.
      max_new_tokens: every turn and feedback of a sample together (rollout.max_new_tokens).
      max_len: prompt + completion per sampler slot (rollout.max_len).
      workers: threads running feedback.
      request: sampling settings of a continuation (temperature, top_k, top_p, stop_token_ids).
    """

    def __init__(self, *, turns: int, template: str, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], feedback: Callable[[str, str], tuple[bool, str]],
                 max_new_tokens: int, max_len: int, workers: int = 2, request: dict | None = None) -> None:
        self.turns, self.template, self.encode, self.decode, self.feedback = turns, template, encode, decode, feedback
        self.max_new_tokens, self.max_len, self.request = max_new_tokens, max_len, dict(request or {})
        self._samples: dict[Key, _Sample] = {}
        self._ready: queue.Queue = queue.Queue()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers),
                                                           thread_name_prefix="code-feedback")
        self.counters: collections.Counter = collections.Counter()
        self.timeline = None  # a SpanRecorder: each feedback run as a "feedback" span on its own lane

    @classmethod
    def for_job(cls, config, tokenizer) -> "FeedbackTurns | None":
        """What a job's config asks for (None when rollout.feedback_turns is 0): code feedback with the reward's
        limits, the tokenizer's encode / decode and end-of-sequence ids, the rollout's sampling settings."""
        r = config.rollout
        if not r.feedback_turns:
            return None
        return cls.factory(config, tokenizer, r.feedback_turns)(
            max_new_tokens=r.max_new_tokens, max_len=r.max_len,
            request=dict(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                         stop_token_ids=tuple(tokenizer.eos_token_ids)))

    @classmethod
    def factory(cls, config, tokenizer, turns: int) -> Callable[..., "FeedbackTurns"]:
        """A FeedbackTurns maker with ``turns`` extra turns and everything else a job's config says (code feedback on
        rollout.feedback_cases cases with the reward's limits, rollout.feedback_template, the tokenizer, a thread per
        reward worker); call it with ``max_new_tokens``, ``max_len`` and ``request``. The evaluation makes one per
        sampler stream and temperature (evaluation.batch.generate_for_eval's ``repair``)."""
        import functools

        from areal_jax.rewards.code_feedback import code_feedback

        feedback = functools.partial(code_feedback, cases=config.rollout.feedback_cases,
                                     case_timeout_s=config.reward.code_case_timeout_s,
                                     allow_numpy=config.reward.code_allow_numpy)
        template = resolve_feedback_template(config.rollout.feedback_template, tokenizer)
        return functools.partial(cls, turns=int(turns), template=template,
                                 encode=tokenizer.encode, decode=tokenizer.decode, feedback=feedback,
                                 workers=config.reward.num_workers)

    def add(self, key: Key, completion: Completion, prompt: list[int], answer: str) -> bool:
        """A turn of sample ``key`` finished. True: the sample is final (take it with ``final``); False: its
        feedback is being computed (``poll``)."""
        sample = self._samples.setdefault(key, _Sample(list(prompt), answer))
        n = len(completion.tokens)
        sample.segments.append((True, np.asarray(completion.tokens, np.int32),
                                np.asarray(completion.logprobs, np.float32), np.asarray(completion.versions, np.int32)))
        sample.last = completion
        routes = getattr(completion, "routes", None)
        if routes is None or sample.routes is None:
            sample.routes = None
        else:
            sample.routes.append(np.asarray(routes)[sum(len(r) for r in sample.routes):])
        if (sample.turns > self.turns or completion.finish_reason != "stop" or n == 0
                or sample.generated >= self.max_new_tokens):
            return True
        text = self.decode(list(np.asarray(completion.tokens)))
        future = self._pool.submit(self._timed_feedback, text, answer)
        future.add_done_callback(lambda f, key=key: self._ready.put((key, f)))
        self.counters["feedback_runs"] += 1
        return False

    def _timed_feedback(self, text: str, answer: str) -> tuple[bool, str]:
        start = time.monotonic()
        try:
            return self.feedback(text, answer)
        finally:
            if self.timeline is not None:
                self.timeline.complete("feedback", time.monotonic() - start, lane="feedback")

    def poll(self) -> tuple[list[Key], list[Request]]:
        """Samples whose feedback arrived: (keys now final, continuation requests to submit)."""
        finals, requests = [], []
        while True:
            try:
                key, future = self._ready.get_nowait()
            except queue.Empty:
                return finals, requests
            sample = self._samples.get(key)
            if sample is None:  # discarded meanwhile
                continue
            try:
                passed, text = future.result()
            except Exception:  # noqa: BLE001 - no feedback: the sample stands as it is
                passed, text = True, ""
                self.counters["feedback_errors"] += 1
            if passed:
                self.counters["feedback_passed"] += 1
                finals.append(key)
                continue
            shown = np.asarray(self.encode(self.template.format(feedback=text)), np.int32)
            so_far = np.concatenate([tokens for _, tokens, _, _ in sample.segments])
            prompt = sample.prompt + so_far.tolist() + shown.tolist()
            budget = min(self.max_new_tokens - len(so_far) - len(shown), self.max_len - len(prompt))
            if budget < 1:
                self.counters["feedback_no_room"] += 1
                finals.append(key)
                continue
            version = int(sample.last.versions[-1]) if len(sample.last.versions) else 0
            sample.segments.append((False, shown, np.zeros(len(shown), np.float32),
                                    np.full(len(shown), version, np.int32)))
            self.counters["feedback_turns"] += 1
            requests.append(Request(id=(TURN, key[0], key[1], sample.turns), prompt=prompt, max_new_tokens=budget,
                                    n=1, **self.request))

    def final(self, key: Key) -> tuple[Completion, list[int]]:
        """Sample ``key`` as one Completion (every turn and feedback; feedback out of the loss) and the tokens of its
        last turn (what the reward scores). It leaves this object."""
        sample = self._samples.pop(key)
        is_model = [np.full(len(tokens), model) for model, tokens, _, _ in sample.segments]
        turn_of, attempts = [], 0
        for model, tokens, _, _ in sample.segments:
            turn_of.append(np.full(len(tokens), attempts, np.int32))  # a feedback: the attempt after it
            attempts += int(model)
        parts = list(zip(*[(tokens, logp, versions) for _, tokens, logp, versions in sample.segments]))
        merged = Completion(key[0], key[1], sample.prompt, np.concatenate(parts[0]).astype(np.int32),
                            np.concatenate(parts[1]).astype(np.float32), np.concatenate(parts[2]).astype(np.int32),
                            sample.last.finish_reason, getattr(sample.last, "error", None))
        if sample.turns > 1:
            merged.loss_mask = np.concatenate(is_model).astype(np.float32)
            merged.turns = np.concatenate(turn_of).astype(np.int32)
        routes = None if sample.routes is None else np.concatenate(sample.routes)
        if routes is not None and len(routes) == len(sample.prompt) + len(merged.tokens):
            merged.routes = routes
        return merged, list(np.asarray(sample.last.tokens))

    def discard(self, key: Key) -> None:
        """Drop sample ``key`` (its turn failed in the sampler: it is scored as that error)."""
        self._samples.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def turn_advantages(rewards: np.ndarray, completions: list, group_size: int, mode: str
                    ) -> tuple[np.ndarray, list[np.ndarray | None] | None]:
    """(per-sample advantages, per-token advantages or None) of a group (see the module doc): with no multi-turn
    sample, plain ``group_advantages`` and None; else the first attempts' advantages, and for each multi-turn sample
    its tokens' advantages: its first attempt's, then for its later turns its final reward against the final rewards
    of the group's other multi-turn samples (0 when it is the only one)."""
    turns = [getattr(c, "turns", None) for c in completions]
    if all(t is None for t in turns):
        return np.asarray(group_advantages(rewards, group_size, mode=mode), np.float32), None
    first_rewards = np.array([r if t is None else 0.0 for r, t in zip(rewards, turns)], np.float32)
    first = np.asarray(group_advantages(first_rewards, group_size, mode=mode), np.float32)
    multi = [i for i, t in enumerate(turns) if t is not None]
    later = np.zeros(len(rewards), np.float32)
    if len(multi) > 1:
        later[multi] = np.asarray(group_advantages(np.asarray(rewards, np.float32)[multi], len(multi), mode=mode))
    tokens = [None if t is None else np.where(t == 0, first[i], later[i]).astype(np.float32)
              for i, t in enumerate(turns)]
    return first, tokens


def attempt_tokens(completion: Completion, attempt: int) -> np.ndarray:
    """The tokens the model generated in ``attempt`` (0: the first; -1: the last) of a sample, without the feedback
    shown before it; a one-turn completion's tokens are its only attempt."""
    tokens = np.asarray(completion.tokens)
    turns = getattr(completion, "turns", None)
    if turns is None:
        if attempt not in (0, -1):
            raise IndexError(f"attempt {attempt} of a one-turn completion")
        return tokens
    turns = np.asarray(turns)
    if attempt < 0:
        attempt += int(turns.max()) + 1
    mask = np.ones(len(tokens), bool) if completion.loss_mask is None else np.asarray(completion.loss_mask) > 0
    return tokens[(turns == attempt) & mask]
