"""How a model is prompted (kvfuse/fusion/prompt_style.py), chosen at load from its real tokenizer: the
default model's tokenizer as it is (chat), with its chat template removed (a base model: the documented
base-model prompt, answers cut at its stop strings), and with Gemma 2's template text (which raises on a
system role: the system text opens the user turn). Every prompt the service builds follows from
`template_halves`, so the real engine's prompt parts are checked against the rendering."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvfuse.fusion import FusionEngine, FusionOptions, GenerationOptions
from kvfuse.fusion.engine import solo
from kvfuse.fusion.engine.generation import Generation
from kvfuse.fusion.prompt import prompt_texts, stop_token_ids, template_halves
from kvfuse.fusion.prompt_style import BASE, BASE_STOPS, CHAT, SYSTEM_IN_USER, style_of

# Gemma 2's chat template as google/gemma-2-2b-it publishes it (tokenizer_config.json).
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def _tokenizer(path: str, template: str | None):
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    return tok


def test_a_chat_template_with_a_system_turn_is_used_as_it_is(tokenizer) -> None:
    assert style_of(tokenizer).name == CHAT and style_of(tokenizer).stop_strings == ()


def test_a_tokenizer_without_chat_template_gets_the_base_model_prompt(default_llm_path: str) -> None:
    tok = _tokenizer(default_llm_path, None)
    style = style_of(tok)
    assert style.name == BASE and "no chat template" in style.why and style.stop_strings == BASE_STOPS
    before, after = template_halves(tok, "Answer briefly.")
    assert (before, after) == ("Answer briefly.\n\n", "\nAnswer:")  # SmolLM2's tokenizer adds no BOS
    prefix, question = prompt_texts(tok, "Who wrote it?", "Answer briefly.")
    assert prefix + "DOCS" + question == "Answer briefly.\n\nDOCS\n\nQuestion: Who wrote it?\nAnswer:"
    assert template_halves(tok, None) == ("", "\nAnswer:")
    assert stop_token_ids(tok, None) == {tok.eos_token_id}  # no template tail to take an end-of-turn id from


def test_gemma2s_template_gets_the_system_text_in_the_user_turn(default_llm_path: str) -> None:
    tok = _tokenizer(default_llm_path, GEMMA2_TEMPLATE)
    with pytest.raises(Exception, match="System role not supported"):  # what made every query a 500
        tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                                tokenize=False, add_generation_prompt=True)
    style = style_of(tok)
    assert style.name == SYSTEM_IN_USER and "System role not supported" in style.why
    prefix, question = prompt_texts(tok, "Who wrote it?", "Answer briefly.")
    bos = tok.bos_token
    assert prefix == f"{bos}<start_of_turn>user\nAnswer briefly.\n\n"
    assert question == "\n\nQuestion: Who wrote it?<end_of_turn>\n<start_of_turn>model\n"
    rendered = tok.apply_chat_template([{"role": "user", "content": "Answer briefly.\n\nDOCS\n\nQuestion: Who wrote it?"}],
                                       tokenize=False, add_generation_prompt=True)
    assert prefix + "DOCS" + question == rendered
    assert template_halves(tok, None)[0] == f"{bos}<start_of_turn>user\n"


def test_a_template_that_drops_the_system_turn_folds_it_too(default_llm_path: str) -> None:
    tok = _tokenizer(default_llm_path, "{% for m in messages %}{% if m['role'] == 'user' %}U: {{ m['content'] }}\n"
                                       "{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    assert style_of(tok).name == SYSTEM_IN_USER
    assert template_halves(tok, "S") == ("U: S\n\n", "\nA:")


def test_a_template_that_renders_no_user_turn_falls_back_to_the_base_prompt(default_llm_path: str) -> None:
    tok = _tokenizer(default_llm_path, "{{ raise_exception('this template is broken') }}")
    style = style_of(tok)
    assert style.name == BASE and "this template is broken" in style.why


def test_base_stops_end_an_answer_at_a_blank_line_or_a_new_question(tokenizer) -> None:
    opts = GenerationOptions(max_tokens=64, temperature=0.0)
    for text, answer in (("Paris, in 1889.\n\nQuestion: Where?", "Paris, in 1889."),
                         ("Paris.\nQuestion: And then?", "Paris.")):
        gen = Generation(tokenizer, set(), opts, stop_strings=BASE_STOPS)
        for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
            if gen.finished is None:
                gen.accept_token(token)
        assert gen.finished == "stop" and gen.text == answer


@pytest.mark.slow
def test_the_real_model_answers_a_base_prompt_and_stops(engine: FusionEngine, default_llm_path: str,
                                                         essay_text: str) -> None:
    """The default model's weights under a template-less tokenizer: prompt parts in the base style, a
    fused answer that ends at a stop string, and the same tokens as vanilla at ratio 1.0."""
    tok = _tokenizer(default_llm_path, None)
    base = FusionEngine(engine.model, tok, dtype="float32")
    assert base.prompt_style.name == BASE and base.stop_strings == BASE_STOPS
    prefix_ids, question_ids = base.prompt_parts("What did the author think of the App Store?", "Answer briefly.")
    assert tok.decode(question_ids).endswith("\nAnswer:")
    kvs = base.precompute([prefix_ids, base.tokenize(essay_text)[:120]])
    gen = GenerationOptions(max_tokens=48, temperature=0.0)
    answers = {}
    for method in ("vanilla", "a3"):
        *_, result = solo.generate(base, kvs[0], kvs[1:], question_ids, FusionOptions(method=method, recompute_ratio=1.0),
                                   gen)
        answers[method] = result
    assert answers["a3"].token_ids == answers["vanilla"].token_ids
    done = answers["vanilla"]
    assert done.text.strip() and done.finish_reason == "stop", done
    assert not any(stop in done.text for stop in BASE_STOPS)
