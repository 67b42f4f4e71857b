"""Conversations (rag/conversation.py, fusion/prompt.py's history): earlier turns kept newest first within
the token budget, the retrieval query, and a prompt whose prefix -- what every chunk cache is computed
after -- is the same with or without a history."""

from __future__ import annotations

from kvfuse.fusion.prompt import prompt_texts
from kvfuse.retriever import Chunker
from kvfuse.service.rag.conversation import fit_history, retrieval_query

TURNS = [("user", "Who founded the Veldmark orchard?"), ("assistant", "The Aalders family, in 1921."),
         ("user", "What did they plant first?"), ("assistant", "Pear trees.")]


def test_turns_are_kept_newest_first_within_the_budget(tokenizer) -> None:
    chunker = Chunker(tokenizer, 128)
    cost = [len(chunker.encode(text)) + 4 for _, text in TURNS]
    whole = fit_history(chunker, TURNS, "And when is the harvest?", sum(cost))
    assert whole.history == TURNS and whole.dropped == 0 and whole.warning is None
    last_two = fit_history(chunker, TURNS, "And when is the harvest?", cost[2] + cost[3] + cost[1] - 1)
    assert last_two.history == TURNS[2:] and last_two.dropped == 2 and "2 earlier message(s)" in last_two.warning
    none = fit_history(chunker, TURNS, "q", 0)
    assert none.history == [] and none.dropped == 4


def test_retrieval_searches_every_user_message_kept() -> None:
    assert retrieval_query(TURNS, "And when is the harvest?") == \
        "Who founded the Veldmark orchard?\nWhat did they plant first?\nAnd when is the harvest?"
    assert retrieval_query([], "Who founded it?") == "Who founded it?"
    assert retrieval_query([("assistant", "Hello")], "Who founded it?") == "Who founded it?"


def test_the_history_goes_after_the_documents_and_leaves_the_prefix_alone(tokenizer) -> None:
    prefix, question = prompt_texts(tokenizer, "And when is the harvest?", "Answer briefly.")
    prefix_h, question_h = prompt_texts(tokenizer, "And when is the harvest?", "Answer briefly.", history=TURNS)
    assert prefix_h == prefix
    assert question_h.endswith(question) and "User: Who founded the Veldmark orchard?\nAssistant: The Aalders" \
        in question_h
    assert question_h.index("Assistant: Pear trees.") < question_h.index("Question: And when is the harvest?")
