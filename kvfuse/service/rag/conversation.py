"""Conversations on /v1/chat/completions: which earlier turns go into the prompt, and what retrieval
searches for.

Earlier turns go into the question part of the prompt (fusion/prompt.py, `history`), after the documents:
the prefix and the stored chunk caches stay exactly what a single question uses, so the caches fuse as
today. They are kept newest first while they fit `generation.history_max_tokens`; older ones are dropped
and the answer's warning says how many.

Retrieval searches every user message of the kept history joined to the last one: a follow-up ("and who
founded it?") names its subject only in an earlier turn, maybe two turns back. The simplest rewrite that
measurably finds the right chunk on a follow-up set (a switch of topic then ranks the new subject second,
so it stays among the top_k); the comparison with the other candidates is in
docs/results/conversations/README.md (studies/conversation_followups.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfuse.retriever import Chunker

ROLES = ("user", "assistant")


@dataclass
class Conversation:
    question: str  # the last user message
    history: list[tuple[str, str]] = field(default_factory=list)  # (role, text) of earlier turns kept, oldest first
    dropped: int = 0  # earlier turns left out to fit generation.history_max_tokens

    @property
    def retrieval_query(self) -> str:
        return retrieval_query(self.history, self.question)

    @property
    def warning(self) -> str | None:
        if not self.dropped:
            return None
        return (f"{self.dropped} earlier message(s) of the conversation were left out of the prompt, oldest first, "
                f"to fit generation.history_max_tokens")


def retrieval_query(history: list[tuple[str, str]], question: str) -> str:
    """What retrieval searches for: the earlier user messages kept, oldest first, then the last one."""
    return "\n".join([*(text for role, text in history if role == "user"), question])


def fit_history(chunker: Chunker, turns: list[tuple[str, str]], question: str, budget: int) -> Conversation:
    """The conversation whose earlier `turns` (oldest first) are kept newest first while their tokens fit
    `budget`; a turn that does not fit ends the history there (no gap in the middle of it)."""
    kept: list[tuple[str, str]] = []
    used = 0
    for role, text in reversed(turns):
        n = len(chunker.encode(text)) + 4  # the role label and line breaks around it
        if used + n > budget:
            break
        kept.append((role, text))
        used += n
    kept.reverse()
    return Conversation(question=question, history=kept, dropped=len(turns) - len(kept))
