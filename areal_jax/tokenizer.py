"""Tokenizers saved in the Hugging Face layout, without depending on transformers.

A directory holds ``tokenizer.json`` (read with the ``tokenizers`` package) plus optional
``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json`` and
``chat_template.jinja``. Chat templates are rendered with a sandboxed jinja2 environment set up the way
transformers sets it up (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``, a
``tojson`` filter that keeps non-ASCII text), so a prompt rendered here is byte-identical to
``AutoTokenizer.apply_chat_template``.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

__all__ = ["Tokenizer", "render_chat_template"]

_CLEANUP_RULES = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Renders a chat template the way transformers does.

    Args:
      template: jinja2 source of the chat template.
      messages: list of ``{"role": str, "content": str}`` dicts.
      add_generation_prompt: append the header that opens the assistant's turn.
      **variables: extra template variables (``bos_token``, ``eos_token``, ``tools``, ...).
    Raises:
      ValueError: a message is not a dict with a string role, or the template raised an exception.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                         f"{type(messages).__name__}.")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' (and usually 'content'), "
                             f"got {message!r}.")
        plain.append(dict(message))
    try:
        return _compile_template(template).render(
            messages=plain, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"The chat template refused these messages: {err}") from err


def _token_content(value: Any) -> str | None:
    """A special token entry is a string, an AddedToken dict ``{"content": ...}`` or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"Cannot read a special token from {value!r}: expected a string or "
                     f"{{'content': str}}.")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); fix or remove the file.") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"Expected a token id or a list of token ids, got {value!r}.")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of a checkpoint.

    Token ids are python ints; sequences are ``list[int]``.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None,
                 unk_token: str | None = None, chat_template: str | None = None,
                 stop_token_ids: Iterable[int] = (), clean_up_tokenization_spaces: bool = False,
                 allow_missing_eos: bool = False) -> None:
        """Args:
          backend: the fast tokenizer (model, pre-tokenizer, decoder, added tokens).
          bos_token / eos_token / pad_token / unk_token: token strings, each present in the vocabulary.
          chat_template: jinja2 chat template, or None when the tokenizer has none.
          stop_token_ids: ids that end generation besides the EOS token (e.g. from generation_config).
          clean_up_tokenization_spaces: apply the WordPiece-era space clean-up after decoding (ignored
            for BPE models, as transformers does).
          allow_missing_eos: accept a tokenizer without an EOS token (generation then needs explicit
            stop ids).
        """
        self._backend = backend
        self._tokens: dict[str, str | None] = {
            "bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token}
        self._token_ids: dict[str, int | None] = {}
        for name, token in self._tokens.items():
            if token is None:
                self._token_ids[name] = None
                continue
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"The {name} {token!r} is not in the vocabulary; add it to tokenizer.json "
                                 f"or fix {name} in tokenizer_config.json.")
            self._token_ids[name] = token_id
        if self._token_ids["eos_token"] is None and not allow_missing_eos:
            raise ValueError("The tokenizer has no EOS token, so generation could never stop. Set eos_token in "
                             "tokenizer_config.json (or eos_token_id in generation_config.json), or pass "
                             "allow_missing_eos=True and give explicit stop ids.")
        vocab = backend.get_vocab_size(with_added_tokens=True)
        for token_id in stop_token_ids:
            if not 0 <= int(token_id) < vocab:
                raise ValueError(f"Stop token id {token_id} is outside the vocabulary [0, {vocab}).")
        stops = [self._token_ids["eos_token"]] if self._token_ids["eos_token"] is not None else []
        stops += [int(t) for t in stop_token_ids if int(t) not in stops]
        self._stop_ids = tuple(dict.fromkeys(stops))
        self.chat_template = chat_template
        # Variables every rendering of the chat template gets (e.g. {"enable_thinking": False} for Qwen3's template);
        # the data config's chat_template_vars, set where a job loads its tokenizer.
        self.template_variables: dict[str, Any] = {}
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    # ------------------------------------------------------------------ loading and saving
    @classmethod
    def from_pretrained(cls, directory: str, *, allow_missing_eos: bool = False) -> "Tokenizer":
        """Loads a tokenizer saved in the Hugging Face layout from ``directory``."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"No tokenizer.json in {directory!r}. Only fast tokenizers are supported: convert a slow "
                f"tokenizer once with transformers (AutoTokenizer.from_pretrained(...).save_pretrained(...)).")
        backend = tokenizers.Tokenizer.from_file(path)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
        generation = _read_json(os.path.join(directory, "generation_config.json"))

        tokens: dict[str, str | None] = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = _token_content(config.get(name))
            tokens[name] = token if token is not None else _token_content(special_map.get(name))
        gen_eos = _ids(generation.get("eos_token_id"))
        for name, key in (("bos_token", "bos_token_id"), ("pad_token", "pad_token_id")):
            gen_id = _ids(generation.get(key))
            if tokens[name] is None and gen_id:
                tokens[name] = backend.id_to_token(gen_id[0])
        if tokens["eos_token"] is None and gen_eos:
            tokens["eos_token"] = backend.id_to_token(gen_eos[0])
        stop_ids = gen_eos + _ids(config.get("stop_token_ids"))

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}], transformers picks "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        template_json = _read_json(os.path.join(directory, "chat_template.json"))
        if template is None and isinstance(template_json.get("chat_template"), str):
            template = template_json["chat_template"]
        return cls(backend, chat_template=template, stop_token_ids=stop_ids,
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                   allow_missing_eos=allow_missing_eos, **tokens)

    def save_pretrained(self, directory: str) -> None:
        """Writes tokenizer.json and tokenizer_config.json so that transformers' AutoTokenizer loads them."""
        os.makedirs(directory, exist_ok=True)
        self._backend.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "clean_up_tokenization_spaces": self._clean_up}
        config.update({k: v for k, v in self._tokens.items() if v is not None})
        extra_stops = [t for t in self._stop_ids if t != self._token_ids["eos_token"]]
        if extra_stops:
            config["stop_token_ids"] = extra_stops
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> token ids. add_special_tokens applies the tokenizer's post-processor (e.g. a BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}.")
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def batch_encode(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Several texts -> one id list each (encoded in parallel by the backend)."""
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"batch_encode expects strings; texts[{i}] is {type(text).__name__}.")
        return [list(e.ids) for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Token ids (list, tuple or 1-D integer array) -> text."""
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUP_RULES:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """Token ids -> token strings (None for ids outside the vocabulary)."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """A token string -> its id, or None when it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **variables: Any) -> str | list[int]:
        """Renders ``messages`` with the chat template; returns the text, or its ids when tokenize=True.

        The special tokens (bos_token, eos_token, pad_token, unk_token) are template variables, as in
        transformers, then ``template_variables``; ``variables`` may add or override any of them.
        """
        if self.chat_template is None:
            raise ValueError("This tokenizer has no chat template. Use a plain prompt template "
                             "(use_chat_template=False) or set chat_template in tokenizer_config.json.")
        context = {k: v for k, v in self._tokens.items() if v is not None}
        context.update(self.template_variables)
        context.update(variables)
        text = render_chat_template(self.chat_template, messages,
                                    add_generation_prompt=add_generation_prompt, **context)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ------------------------------------------------------------------ properties
    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def bos_token(self) -> str | None:
        return self._tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._tokens["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self._tokens["pad_token"] if self._tokens["pad_token"] is not None else self.eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self._token_ids["bos_token"]

    @property
    def eos_token_id(self) -> int | None:
        return self._token_ids["eos_token"]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the EOS token first, then extra stop ids (deduplicated)."""
        return self._stop_ids

    @property
    def pad_token_id(self) -> int | None:
        """The pad id; falls back to the EOS id when the tokenizer defines no pad token."""
        pad = self._token_ids["pad_token"]
        return pad if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (``len(tokenizer)`` in transformers)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"pad={self.pad_token!r}, stops={self.eos_token_ids}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

