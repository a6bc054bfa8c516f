"""Tokenizer: loading, encode/decode and chat templates, checked against transformers on the same files."""
import json
import os

import pytest
import tokenizers
from tokenizers import processors

from areal_jax.testing.tokenizers import byte_level_bpe
from areal_jax.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% if loop.first and message['role'] != 'system' %}{{ bos_token }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CORPUS = [
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Ünïcödé text: naïve café, 数学, emoji-free. Tabs\tand  double  spaces.",
]
TEXTS = [
    "Natalia sold 48 clips in April.",
    "  leading spaces and trailing ",
    "naïve café 数学 <|im_end|> after a special token",
    "line one\nline two\n\nline four",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": "Solve: 48/2 = ?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, café!"},
     {"role": "user", "content": "數學"}],
]


def _backend(bos_post_processor: bool = False) -> tokenizers.Tokenizer:
    tok = byte_level_bpe(CORPUS * 5, SPECIALS, vocab_size=400)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tok"))
    Tokenizer(_backend(bos_post_processor=True), bos_token="<s>", eos_token="<|im_end|>",
              pad_token="<|endoftext|>", chat_template=CHATML,
              stop_token_ids=[0]).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf(saved_dir):
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the parity checks")
    return transformers.AutoTokenizer.from_pretrained(saved_dir)


def test_encode_decode_match_transformers(saved_dir, hf):
    ours = Tokenizer.from_pretrained(saved_dir)
    for text in TEXTS:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = ours.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.batch_encode(TEXTS) == [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    assert ours.encode(TEXTS[0], add_special_tokens=True)[0] == ours.bos_token_id
    assert ours.decode(ours.encode(TEXTS[2])) == TEXTS[2].replace("<|im_end|>", "")


def test_chat_template_matches_transformers(saved_dir, hf):
    ours = Tokenizer.from_pretrained(saved_dir)
    for messages in MESSAGES:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            ids = ours.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            hf_ids = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
            assert ids == list(hf_ids)
    # bos_token is a template variable: it opens a conversation without a system turn.
    assert ours.apply_chat_template(MESSAGES[0]).startswith("<s><|im_start|>user\nWhat is 2+2?")
    # raise_exception in the template surfaces as a clear error (transformers raises TemplateError).
    with pytest.raises(ValueError, match="Unsupported role: tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(Exception, match="Unsupported role: tool"):
        hf.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_special_tokens_and_saved_config(saved_dir, hf):
    ours = Tokenizer.from_pretrained(saved_dir)
    assert ours.eos_token_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_ids == (ours.eos_token_id, 0)  # the extra stop id survives save/load


def test_loads_transformers_saved_directory(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is needed for the parity checks")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_backend(), eos_token="<|im_end|>",
                                              pad_token="<|endoftext|>", chat_template=CHATML)
    hf.save_pretrained(str(tmp_path))
    ours = Tokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template == CHATML  # read from tokenizer_config.json or chat_template.jinja
    assert ours.eos_token == "<|im_end|>" and ours.pad_token == "<|endoftext|>" and ours.bos_token is None
    for messages in MESSAGES:
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def _write_dir(path, config=None, special_map=None, generation=None):
    os.makedirs(path, exist_ok=True)
    _backend().save(os.path.join(path, "tokenizer.json"))
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map),
                       ("generation_config.json", generation)):
        if data is not None:
            with open(os.path.join(path, name), "w") as f:
                json.dump(data, f)
    return str(path)


def test_special_tokens_from_all_config_files(tmp_path):
    backend = _backend()
    im_end, eot = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")
    # eos as an AddedToken dict, pad from special_tokens_map.json, extra stop ids from generation_config.
    directory = _write_dir(tmp_path / "a", config={"eos_token": {"content": "<|im_end|>", "special": True}},
                           special_map={"pad_token": "<|endoftext|>"},
                           generation={"eos_token_id": [im_end, eot], "bos_token_id": eot})
    tok = Tokenizer.from_pretrained(directory)
    assert tok.eos_token_id == im_end
    assert tok.eos_token_ids == (im_end, eot)
    assert tok.pad_token_id == eot and tok.bos_token_id == eot
    # No eos in the tokenizer files: generation_config's first eos id becomes the EOS token.
    tok = Tokenizer.from_pretrained(_write_dir(tmp_path / "b", config={}, generation={"eos_token_id": eot}))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_ids == (eot,)
    # No pad token: pad falls back to eos.
    tok = Tokenizer.from_pretrained(_write_dir(tmp_path / "c", config={"eos_token": "<|im_end|>"}))
    assert tok.pad_token_id == tok.eos_token_id == im_end


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="No tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
    directory = _write_dir(tmp_path / "noeos", config={"pad_token": "<|endoftext|>"})
    with pytest.raises(ValueError, match="no EOS token"):
        Tokenizer.from_pretrained(directory)
    tok = Tokenizer.from_pretrained(directory, allow_missing_eos=True)
    assert tok.eos_token_id is None and tok.eos_token_ids == ()
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Tokenizer(_backend(), eos_token="<missing>")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(_backend(), eos_token="<|im_end|>").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="messages"):
        Tokenizer(_backend(), eos_token="<|im_end|>", chat_template=CHATML).apply_chat_template("hello")
