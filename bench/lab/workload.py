"""The lab's request stream (pure, deterministic from a seed): multi-turn chat sessions over
a few long system prompts, questions over long shared documents, and bursts of questions
over a new document arriving together, with open-loop arrival times. Every router in a lab
run gets exactly this stream.

Sizes are in words, one token each with the lab's tokenizer. The defaults hold more distinct
prefix blocks than the fleet's caches (3 engines x 128 blocks of 32 tokens), so engines evict
and where a prefix lives matters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One request: when it is sent (seconds from the run's start) and its prompt."""

    at: float
    kind: str  # "chat", "doc" or "burst"
    key: str  # the session or document it belongs to
    prompt: str


@dataclass(frozen=True)
class Shape:
    """The stream's sizes; the defaults are the lab's."""

    system_prompts: int = 3
    system_words: int = 256
    sessions: int = 30
    turns: int = 3
    turn_words: int = 40  # a user message, and the scripted answer after it
    documents: int = 14
    document_words: int = 480
    questions: int = 84
    question_words: int = 24
    seconds: float = 66.0  # arrivals spread over this long
    think_seconds: tuple[float, float] = (3.0, 7.0)  # between a session's turns
    # Bursts: a document no one asked about before, asked by several users at once (a
    # fresh link shared in a team): each burst's questions arrive burst_gap_s apart, all
    # within the first one's prefill, before any engine's events can show the document.
    bursts: int = 4
    burst_questions: int = 4
    burst_gap_s: float = 0.03


def stream(words: list[str], shape: Shape = Shape(), seed: int = 11) -> list[Request]:
    """The requests in order of arrival."""
    rng = random.Random(seed)

    def text(count: int) -> str:
        return " ".join(rng.choice(words) for _ in range(count))

    systems = [text(shape.system_words) for _ in range(shape.system_prompts)]
    documents = [text(shape.document_words) for _ in range(shape.documents)]
    requests: list[Request] = []
    last_start = shape.seconds - shape.turns * shape.think_seconds[1]
    for s in range(shape.sessions):
        at = rng.uniform(0, max(last_start, 1.0))
        history = systems[s % shape.system_prompts]
        for _turn in range(shape.turns):
            history = f"{history} {text(shape.turn_words)}"
            requests.append(Request(at, "chat", f"session-{s}", history))
            history = f"{history} {text(shape.turn_words)}"  # the scripted answer
            at += rng.uniform(*shape.think_seconds)
    # Documents by a skewed popularity: a few are asked about often.
    weights = [1.0 / (d + 1) ** 0.8 for d in range(shape.documents)]
    for _ in range(shape.questions):
        d = rng.choices(range(shape.documents), weights)[0]
        requests.append(
            Request(
                rng.uniform(0, shape.seconds),
                "doc",
                f"document-{d}",
                f"{documents[d]} {text(shape.question_words)}",
            )
        )
    for b in range(shape.bursts):
        document = text(shape.document_words)
        at = rng.uniform(0, shape.seconds - 1.0)
        for q in range(shape.burst_questions):
            requests.append(Request(at + q * shape.burst_gap_s, "burst", f"burst-{b}",
                                    f"{document} {text(shape.question_words)}"))  # fmt: skip
    requests.sort(key=lambda r: r.at)
    return requests
