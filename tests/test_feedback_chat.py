"""rollout.feedback_template="chat": the repair turn's frame read off a tokenizer's chat template. A prompt, a sampled
turn ending in its stop token and the frame around the feedback must spell the conversation the chat template
renders when the feedback is the next user turn."""
import pytest

from areal_jax.config import ConfigError, JobConfig
from areal_jax.data.code_tokenizer import build_code_tokenizer
from areal_jax.data.pipeline import DataConfig
from areal_jax.rewards.pool import RewardConfig
from areal_jax.sampler.config import RolloutConfig
from areal_jax.sampler.turns import FeedbackTurns, chat_feedback_template, resolve_feedback_template
from areal_jax.testing.tokenizers import byte_level_bpe
from areal_jax.tokenizer import Tokenizer

# Turn frames as ChatML (Qwen) and Llama 3 write them, each a small jinja template of its own.
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# ChatML whose final assistant turn carries an empty reasoning block (earlier assistant turns do not).
REASONING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
             "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
             "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BRACES = ("{% for m in messages %}{{ '{' + m['role'] + '} ' + m['content'] + '<end>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '{assistant} ' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<end>"]


@pytest.fixture(scope="module")
def backend():
    return byte_level_bpe(["def f(x):\n    return max(x, 12)", "f(58) returned 116, expected 13."] * 5, SPECIALS)


def _tokenizers(backend):
    eot = backend.token_to_id("<|eot_id|>")
    return {
        "chatml": Tokenizer(backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML),
        "llama3": Tokenizer(backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                            chat_template=LLAMA3, stop_token_ids=[eot]),
        "braces": Tokenizer(backend, eos_token="<end>", chat_template=BRACES),
        "reasoning": Tokenizer(backend, eos_token="<|im_end|>", chat_template=REASONING),
    }


@pytest.mark.parametrize("name, frame", [
    ("chatml", "\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"),
    ("llama3", "<|start_header_id|>user<|end_header_id|>\n\n{feedback}<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("braces", "{{user}} {feedback}<end>{{assistant}} "),
    ("reasoning", "\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"),  # the template's own braces, escaped for str.format
])
def test_the_frame_continues_the_conversation_the_chat_template_renders(backend, name, frame):
    tok = _tokenizers(backend)[name]
    assert chat_feedback_template(tok) == frame
    question, program, feedback = "Write f(x).", "def f(x):\n    return x", "f(58) returned 58, expected 13."
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    stop = tok.convert_ids_to_tokens([tok.eos_token_ids[-1] if name == "llama3" else tok.eos_token_id])[0]
    shown = prompt + program + stop + frame.format(feedback=feedback)
    assert shown == tok.apply_chat_template([{"role": "user", "content": question},
                                             {"role": "assistant", "content": program},
                                             {"role": "user", "content": feedback}], add_generation_prompt=True)


def test_the_code_tokenizers_chat_frame_is_its_prompt_frame():
    assert chat_feedback_template(build_code_tokenizer()) == "Question: {feedback}\nAnswer:"
    assert resolve_feedback_template("\n{feedback}\n", None) == "\n{feedback}\n"


def test_frames_that_cannot_be_read_off_are_clear_errors(backend):
    plain = Tokenizer(backend, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="this tokenizer has none: write the frame out"):
        chat_feedback_template(plain)
    no_eot = Tokenizer(backend, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", chat_template=LLAMA3)
    with pytest.raises(ValueError, match=r"ends an assistant turn with '<\|eot_id\|>.*none of the tokenizer's stop"):
        chat_feedback_template(no_eot)
    dropping = Tokenizer(backend, eos_token="<|im_end|>", chat_template=(
        "{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['role'] + ': ' + m['content'] }}"
        "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"))
    with pytest.raises(ValueError, match="does not render an assistant turn followed by a user turn"):
        chat_feedback_template(dropping)


def test_chat_frames_need_chat_prompts_and_the_factory_resolves_them(backend):
    def job(use_chat_template, template="chat"):
        return JobConfig(data=DataConfig(task="code", use_chat_template=use_chat_template),
                         reward=RewardConfig(fn="code", timeout_s=30.0),
                         rollout=RolloutConfig(feedback_turns=1, feedback_template=template))

    with pytest.raises(ConfigError, match="pass --config.data.use_chat_template=True"):
        job(False)
    with pytest.raises(ConfigError, match="lacks the '\\{feedback\\}' placeholder \\(or give 'chat'"):
        job(True, "no frame")
    config = job(True)
    tok = _tokenizers(backend)["chatml"]
    turns = FeedbackTurns.factory(config, tok, 1)(max_new_tokens=64, max_len=128)
    try:
        assert turns.template == "\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"
    finally:
        turns.close()
