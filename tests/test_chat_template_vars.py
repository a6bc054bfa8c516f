"""data.chat_template_vars: extra variables of the chat template (Qwen3's enable_thinking), rendered as transformers
renders them, checked before anything loads, and reaching every prompt the job and the evaluation build."""
import json

import pytest

from areal_jax.config import ConfigError
from areal_jax.data.pipeline import DataConfig, load_prompt_source
from areal_jax.testing.tokenizers import byte_level_bpe
from areal_jax.tokenizer import Tokenizer

# A ChatML template that, like Qwen3's, closes an empty reasoning block in the generation prompt when thinking is off.
THINKING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
            "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def backend():
    return byte_level_bpe(["What is 2+3? <think> </think> 5"] * 5, SPECIALS)


def _tokenizer(backend, **variables):
    tok = Tokenizer(backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=THINKING)
    tok.template_variables.update(variables)
    return tok


@pytest.mark.parametrize("variables", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_the_variables_render_as_transformers_renders_them(backend, variables):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    reference.chat_template = THINKING
    want = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **variables)
    assert _tokenizer(backend, **variables).apply_chat_template(MESSAGES) == want
    assert ("<think>" in want) == (variables == {"enable_thinking": False})


def test_every_prompt_of_a_source_gets_them(backend, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "What is 2+3?", "answer": "5"}) + "\n")
    for variables, think in (({}, False), ({"enable_thinking": False}, True)):
        source = load_prompt_source(str(path), _tokenizer(backend, **variables), use_chat_template=True)
        text = _tokenizer(backend).decode(list(source.items[0].prompt_tokens), skip_special_tokens=False)
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if think else "<|im_start|>assistant\n")


@pytest.mark.parametrize("value, message", [
    ("enable_thinking=false", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ('{"enable_thinking": false}', "use_chat_template=True"),
])
def test_bad_variables_are_one_sentence_before_anything_loads(value, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(chat_template_vars=value)
    ok = DataConfig(chat_template_vars='{"enable_thinking": false}', use_chat_template=True)
    assert ok.template_variables == {"enable_thinking": False}
