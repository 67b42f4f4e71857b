"""Follow-up questions in a conversation: which retrieval query finds the document a follow-up is about,
and does the answer then hold the fact. Prints the tables of docs/results/conversations/README.md.

Twelve made-up towns, one short document each (name, region, river, founder, festival: nothing a model
knows beforehand). Conversations of three kinds: a follow-up after a question naming the town ("Where is
Marlow Vey?" / "Which river flows through it?"), a second follow-up two turns after the name, and a
switch of topic to another town named in the last message. Candidates for the retrieval query: the last
user message alone (what the service did before), the previous user message and the last, every user
message (what rag/conversation.py sends), the last assistant message and the last user message.

    PYTHONPATH=$PWD .venv/bin/python studies/conversation_followups.py            # retrieval, in process
    PYTHONPATH=$PWD .venv/bin/python studies/conversation_followups.py --answers  # also answers, local server
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

TOWNS = [  # name, region, river, founder, year, festival
    ("Marlow Vey", "the northern fens", "Asker", "Edda Brun", 1342, "the first eel catch"),
    ("Quillon", "the chalk downs", "Severin", "Tobias Marr", 1188, "the lavender harvest"),
    ("Ostrava Nel", "the pine coast", "Kalda", "Ines Varo", 1560, "the return of the herring boats"),
    ("Brindlemoor", "the western moors", "Tavy", "Olwen Hart", 1420, "the shearing of the sheep"),
    ("Castel Rua", "the olive hills", "Orzo", "Matteo Lenz", 1277, "the pressing of the olives"),
    ("Fennick", "the river delta", "Lune", "Hanna Falk", 1605, "the spring floods"),
    ("Sorrelby", "the limestone dales", "Wharl", "Piet Dorn", 1391, "the cheese market"),
    ("Harrowgate Reach", "the salt marshes", "Brede", "Lisbet Moor", 1499, "the salt harvest"),
    ("Valdoro", "the high plateau", "Isarn", "Rafael Quinn", 1150, "the first snow"),
    ("Tern Halloway", "the cliff coast", "Morrow", "Signe Aal", 1533, "the puffin landing"),
    ("Eldmere", "the lake district", "Cask", "Bram Oster", 1318, "the midsummer regatta"),
    ("Pellworth", "the clay vale", "Ouse", "Greta Lind", 1666, "the potters' fair"),
]
# The word an answer must hold for each festival (the whole phrase is often cut by max_tokens).
FESTIVAL_WORD = {"the first eel catch": "eel", "the lavender harvest": "lavender", "the return of the herring "
                 "boats": "herring", "the shearing of the sheep": "shearing", "the pressing of the olives": "olives",
                 "the spring floods": "floods", "the cheese market": "cheese", "the salt harvest": "salt",
                 "the first snow": "snow", "the puffin landing": "puffin", "the midsummer regatta": "regatta",
                 "the potters' fair": "potters"}
FACTS = [  # (follow-up question, what the answer must hold: a field of the town's row)
    ("Which river flows through it?", 2),
    ("Who founded it?", 3),
    ("What does its yearly festival celebrate?", 5),
]


def document(town: tuple) -> str:
    name, region, river, founder, year, festival = town
    return (f"{name} is a small town in {region}. The river {river} flows through {name}. {name} was founded by "
            f"{founder} in {year}. Every year {name} holds a festival that celebrates {festival}.")


def holds(answer: str, fact: str) -> bool:
    """Whether an answer states the fact: the river's name, the founder's surname, the festival's word."""
    key = FESTIVAL_WORD.get(fact) or fact.split()[-1]
    return key.lower() in answer.lower()


def conversations() -> list[tuple[str, list[tuple[str, str]], str, int, str]]:
    """(kind, messages, the last user message, the town it is about, the fact its answer must hold)."""
    out = []
    for i, town in enumerate(TOWNS):
        name = town[0]
        q, field = FACTS[i % 3]
        q2, field2 = FACTS[(i + 1) % 3]
        intro = [("user", f"Where is {name}?"), ("assistant", f"{name} is in {town[1]}.")]
        out.append(("follow-up", intro, q, i, str(town[field])))
        second = [*intro, ("user", q), ("assistant", str(town[field]) + ".")]
        out.append(("second follow-up", second, q2, i, str(town[field2])))
        other = TOWNS[(i + 5) % len(TOWNS)]
        out.append(("topic switch", intro, f"And which river flows through {other[0]}?", (i + 5) % len(TOWNS),
                    other[2]))
    return out


def candidates(history: list[tuple[str, str]], question: str) -> dict[str, str]:
    from kvfuse.service.rag.conversation import retrieval_query

    users = [t for r, t in history if r == "user"]
    assistants = [t for r, t in history if r == "assistant"]
    return {
        "last user message": question,
        "previous + last user message": "\n".join([*users[-1:], question]),
        "every user message (the service's)": retrieval_query(history, question),
        "last assistant + last user message": "\n".join([*assistants[-1:], question]),
    }


def retrieval_table() -> str:
    from kvfuse.config import get_settings
    from kvfuse.model_files import resolve_embedder
    from kvfuse.retriever import Embedder, VectorIndex
    from kvfuse.retriever.hybrid import search
    from kvfuse.retriever.keyword_index import KeywordIndex

    s = get_settings()
    embedder = Embedder(resolve_embedder(s.model.embedder), device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        dense = VectorIndex(Path(tmp) / "faiss", embedder.dim, s.retriever)
        keyword = KeywordIndex(Path(tmp) / "kw", s.retriever)
        for i, town in enumerate(TOWNS):
            dense.add(f"town-{i}", embedder.embed([document(town)]))
            keyword.add(f"town-{i}", [document(town)])
        hits: dict[tuple[str, str], list[bool]] = {}
        for kind, history, question, gold, _ in conversations():
            for name, query in candidates(history, question).items():
                top = search("hybrid", query, 2, embed=lambda q: embedder.embed([q])[0], dense=dense,
                             keyword=keyword)
                hits.setdefault((kind, name), []).append(top[0].document_id == f"town-{gold}")
                hits.setdefault((kind + " (top 2)", name), []).append(f"town-{gold}" in [h.document_id for h in top])
    kinds = list(dict.fromkeys(k for k, _ in hits))
    names = list(dict.fromkeys(n for _, n in hits))
    lines = ["| retrieval query | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{sum(hits[k, n])}/{len(hits[k, n])}" for k in kinds) + " |")
    return "\n".join(lines)


def answers_table(max_tokens: int, per_kind: int) -> str:
    """Each conversation through /v1/chat/completions on a local server: the whole conversation, then its
    last user message alone; an answer counts when it holds the fact."""
    import httpx

    from kvfuse.service.cli_client import local_server

    rows: dict[tuple[str, str], list[bool]] = {}
    with local_server(600) as url, httpx.Client(base_url=url, timeout=300) as http:
        docs = [{"id": f"town-{i}", "text": document(t)} for i, t in enumerate(TOWNS)]
        resp = http.post("/v1/documents?wait=true", json={"documents": docs, "collection": "towns"})
        assert resp.status_code in (200, 201), resp.text
        asked: dict[str, int] = {}
        for kind, history, question, _, fact in conversations():
            asked[kind] = asked.get(kind, 0) + 1
            if asked[kind] > per_kind:
                continue
            for label, messages in (("whole conversation", [*history, ("user", question)]),
                                    ("last user message alone", [("user", question)])):
                body = {"model": "kvfuse", "max_tokens": max_tokens, "top_k": 2,
                        "retrieval": {"collections": ["towns"]},
                        "messages": [{"role": r, "content": t} for r, t in messages]}
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                answer = r.json()["choices"][0]["message"]["content"]
                rows.setdefault((kind, label), []).append(holds(answer, fact))
                print(f"{kind} | {label} | {fact} | {answer!r}", file=sys.stderr, flush=True)
    return table(rows)


def tabulate(log: Path) -> str:
    """The answers table from the lines an --answers run printed (to stderr), e.g. of a run cut short."""
    import ast

    rows: dict[tuple[str, str], list[bool]] = {}
    for line in log.read_text().splitlines():
        parts = line.split(" | ", 3)
        if len(parts) == 4 and parts[3].startswith(("'", '"')):
            rows.setdefault((parts[0], parts[1]), []).append(holds(ast.literal_eval(parts[3]), parts[2]))
    return table(rows)


def table(rows: dict[tuple[str, str], list[bool]]) -> str:
    kinds = list(dict.fromkeys(k for k, _ in rows))
    labels = list(dict.fromkeys(n for _, n in rows))
    lines = ["| sent | " + " | ".join(kinds) + " | all |", "|---" * (len(kinds) + 2) + "|"]
    for n in labels:
        cells = [f"{sum(rows[k, n])}/{len(rows[k, n])}" for k in kinds]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {sum(sum(rows[k, n]) for k in kinds)}/"
                     f"{sum(len(rows[k, n]) for k in kinds)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answers", action="store_true", help="also answer each conversation on a local server")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--per-kind", type=int, default=12, help="conversations of each kind answered (of 12)")
    ap.add_argument("--tabulate", type=Path, help="only print the answers table from an --answers run's stderr")
    args = ap.parse_args()
    if args.tabulate:
        print(tabulate(args.tabulate))
        return
    print("Retrieval (hybrid): the town asked about is the first chunk, or among the first two:\n")
    print(retrieval_table())
    if args.answers:
        print("\nAnswers holding the fact (default model, greedy, top_k 2):\n")
        print(answers_table(args.max_tokens, args.per_kind))


if __name__ == "__main__":
    main()
