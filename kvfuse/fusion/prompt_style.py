"""How a model is prompted, chosen once per tokenizer at load (docs/DESIGN.md "The prompt", docs/usage.md
"Base models"): the styles, not the documents' layout (that is `model.prompt_layout`, prompt.py).

- `chat`: the chat template renders a system turn and a user turn; the documents and the question go in
  the user turn.
- `chat-system-in-user`: the template cannot render a system role (Gemma 2's raises "System role not
  supported"; some drop it silently), so the system text opens the first user turn, followed by a blank
  line, as such templates' own models were trained to read it.
- `base`: no chat template (a base model, most GGUFs of base checkpoints), or one that cannot render even
  a user turn: the tokenizer's BOS when it adds one, the system text and a blank line, the documents,
  "\\n\\nQuestion: ...\\nAnswer:". A base model does not end its answer with an end-of-turn token, so the
  answer also stops at a blank line or at a "Question:" line of its own (`BASE_STOPS`) rather than running
  to max_tokens.

Every prompt the service builds goes through `prompt.template_halves`, which asks `style_of`: the query's
prefix and question, the chunks' precompute context, the prompt-cache prefix, the shadow checks and the
fidelity bench all see the same text.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

CHAT, SYSTEM_IN_USER, BASE = "chat", "chat-system-in-user", "base"
BASE_ANSWER = "\nAnswer:"  # ends the question part of a base-model prompt
BASE_STOPS = ("\n\n", "\nQuestion:")  # where a base model's answer ends (beside EOS)
SYSTEM_SEPARATOR = "\n\n"  # after the system text, when it opens the user turn or a base prompt
_PROBE_SYSTEM = "\u2063KVFUSE-SYSTEM\u2063"
_PROBE_USER = "\u2063KVFUSE-USER\u2063"


@dataclass(frozen=True)
class PromptStyle:
    name: str
    why: str  # why this style was chosen (named in /ready and the worker's log)
    bos: str = ""  # base: the BOS token's text when the tokenizer adds one

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return BASE_STOPS if self.name == BASE else ()


_CHOSEN: weakref.WeakKeyDictionary[Any, PromptStyle] = weakref.WeakKeyDictionary()


def style_of(tokenizer: Any) -> PromptStyle:
    """The tokenizer's prompt style, chosen on first use and kept as long as the tokenizer lives."""
    try:
        return _CHOSEN[tokenizer]
    except (KeyError, TypeError):
        pass
    style = choose(tokenizer)
    try:
        _CHOSEN[tokenizer] = style
    except TypeError:  # an object that takes no weak reference: chosen again on each call
        pass
    return style


def render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def choose(tokenizer: Any) -> PromptStyle:
    """Render a probe conversation: a system and a user turn, else the user turn alone."""
    if not getattr(tokenizer, "chat_template", None):
        return base(tokenizer, "the tokenizer has no chat template")
    try:
        text = render(tokenizer, [{"role": "system", "content": _PROBE_SYSTEM},
                                  {"role": "user", "content": _PROBE_USER}])
        if _PROBE_SYSTEM in text and _PROBE_USER in text:
            return PromptStyle(CHAT, "the chat template renders a system turn")
        failed = "the chat template drops the system turn"
    except Exception as err:  # jinja's TemplateError, or what the template's raise_exception raises
        failed = f"the chat template refuses a system turn ({err})"
    try:
        text = render(tokenizer, [{"role": "user", "content": _PROBE_SYSTEM + SYSTEM_SEPARATOR + _PROBE_USER}])
        if _PROBE_USER in text:
            return PromptStyle(SYSTEM_IN_USER, f"{failed}: the system text opens the user turn")
        return base(tokenizer, f"{failed}, and it drops the user turn")
    except Exception as err:
        return base(tokenizer, f"{failed}, and it cannot render a user turn ({err})")


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts its BOS before what it encodes (Gemma's, Llama's do; SmolLM2's does not)."""
    bos_id, bos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None)
    return bool(bos_id is not None and bos and list(tokenizer("a")["input_ids"][:1]) == [bos_id])


def base(tokenizer: Any, why: str) -> PromptStyle:
    return PromptStyle(BASE, f"{why}: the base-model prompt", tokenizer.bos_token if adds_bos(tokenizer) else "")


def base_halves(style: PromptStyle, system_prompt: str | None) -> tuple[str, str]:
    """A base model's text before the documents and after the question."""
    return style.bos + (system_prompt + SYSTEM_SEPARATOR if system_prompt else ""), BASE_ANSWER


def messages_for(style: PromptStyle, system_prompt: str | None, user: str) -> list[dict[str, str]]:
    """The conversation a chat template renders (the system text folded into the user turn when it must)."""
    if not system_prompt:
        return [{"role": "user", "content": user}]
    if style.name == SYSTEM_IN_USER:
        return [{"role": "user", "content": system_prompt + SYSTEM_SEPARATOR + user}]
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]
