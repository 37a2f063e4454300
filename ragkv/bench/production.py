"""A production-shaped RAG workload, modelled on a real trace's proportions.

The measured trace (held out of the repository) looks like this: the system prompt is ~47 %
of prompt tokens and consists of two large parts that repeat on every request around one
part that changes on (almost) every request; retrieved passages are ~42 % (popular ones
recur, in varying order); history ~9 %; within-request duplicates are rare. The synthetic
workload hides all of that (short system prompt, its only changing part a timestamp at the
very end), so plain prefix caching and the assembler are compared here on what real
traffic sends.

Passages are windows of the bundled corpus, drawn by Zipf popularity and sent in a random
order; the changing part (date, customer, request id) sits between the two stable parts.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

from ragkv.bench.workload import RequestSpec, Workload
from ragkv.corpus import demo_corpus
from ragkv.dedup import Chunk
from ragkv.errors import ConfigError

INSTRUCTIONS = (
    "You are the documentation assistant of a software company whose products are written in "
    "Python. You answer questions from engineers, support staff and customers about the "
    "language and its standard library. Your answers must be grounded in the documentation "
    "passages that accompany each question: they are retrieved from the official reference "
    "and are the only source you may rely on. Treat them as authoritative even where they "
    "disagree with what you remember. When several passages are relevant, combine them and "
    "say which statement comes from which passage. When the passages do not contain the "
    "answer, say so in one sentence and suggest which part of the reference to read next; do "
    "not guess, and never invent functions, modules, keywords or options. Prefer short, exact "
    "answers over long explanations, and quote identifiers, keywords and syntax exactly as "
    "the passages spell them.\n"
)
POLICIES = (
    "Formatting rules: start with the direct answer in one or two sentences. Then, if it "
    "helps, give a minimal example as a fenced code block that runs unchanged on a current "
    "Python version. Use bullet points only for lists of three or more items. Do not repeat "
    "the question, do not add greetings or sign-offs, and do not mention these rules. Safety "
    "rules: never reveal account data other than the customer's own, never produce code that "
    "deletes files or contacts the network unless the question explicitly asks for it, and "
    "decline requests that are unrelated to Python or to the company's products. If the "
    "customer seems frustrated, acknowledge it briefly before answering. Escalate to a human "
    "agent, by saying so, when the customer asks for a refund or reports data loss.\n"
)
_NAMES = ("Ada", "Grace", "Linus", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Frances")
_PLANS = ("free", "team", "business", "enterprise")
_QUESTIONS = (
    "What does the documentation say about {topic}?",
    "How does {topic} behave in Python, exactly?",
    "Can you give me an example of {topic}?",
    "What are the pitfalls of {topic}?",
    "Is there anything special about {topic} I should know?",
)


@dataclass(slots=True)
class ProductionConfig:
    """Knobs of :func:`production_workload`; the defaults are the benchmark's default size."""

    requests: int = 40
    passages: int = 80
    zipf_s: float = 1.0
    top_k: int = 4
    duplicate_rate: float = 0.05
    follow_up_rate: float = 0.3
    chunk_size: int = 400
    chunk_overlap: int = 100
    seed: int = 0

    def validate(self) -> None:
        if self.requests < 1 or self.passages < 1 or self.top_k < 1:
            raise ConfigError("requests, passages and top_k must be >= 1")
        for name in ("duplicate_rate", "follow_up_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        if self.zipf_s < 0:
            raise ConfigError(f"zipf_s must be >= 0, got {self.zipf_s}")


def production_workload(config: ProductionConfig | None = None) -> Workload:
    """The seeded production-shaped workload (see the module docs)."""
    config = config or ProductionConfig()
    config.validate()
    rng = random.Random(config.seed)
    corpus = demo_corpus(config.chunk_size, config.chunk_overlap)
    pool = rng.sample(corpus, min(config.passages, len(corpus)))  # Zipf rank = list order
    weights = [1.0 / (rank + 1) ** config.zipf_s for rank in range(len(pool))]
    clock = datetime(2026, 3, 2, 8, 0, 0, tzinfo=UTC)
    sessions: list[tuple[str, str, str]] = []  # (session id, customer, topic)
    requests = []
    for index in range(config.requests):
        clock += timedelta(seconds=rng.randint(5, 400))
        follow_up = bool(sessions) and rng.random() < config.follow_up_rate
        picked = _draw(rng, pool, weights, config.top_k)
        if follow_up:
            session_id, customer, topic = rng.choice(sessions[-6:])
        else:
            customer = f"{rng.choice(_NAMES)} (account {rng.randint(10_000, 99_999)}, "
            customer += f"plan {rng.choice(_PLANS)})"
            topic = picked[0].source_id or "this"
            session_id = f"s{len(sessions)}"
            sessions.append((session_id, customer, topic))
        changing = (
            f"Current date and time: {clock.strftime('%A %d %B %Y, %H:%M')} UTC. "
            f"Customer: {customer}. Request id: {rng.getrandbits(48):012x}.\n"
        )
        chunks = [Chunk(c.text, source_id=c.source_id, metadata=dict(c.metadata)) for c in picked]
        if rng.random() < config.duplicate_rate:
            chunks.insert(rng.randrange(len(chunks) + 1), chunks[rng.randrange(len(chunks))])
        requests.append(
            RequestSpec(
                index=index,
                session_id=session_id,
                system=INSTRUCTIONS + changing + POLICIES,
                question=rng.choice(_QUESTIONS).format(topic=f"'{topic}'"),
                chunks=chunks,
                topic=topic,
                follow_up=follow_up,
            )
        )
    params = {"kind": "production", **asdict(config), "num_sessions": len(sessions)}
    return Workload("production", requests, params)


def _draw(rng: random.Random, pool: list[Chunk], weights: list[float], k: int) -> list[Chunk]:
    """``k`` distinct passages by popularity, in a random (retrieval) order."""
    picked: dict[int, None] = {}
    indices = range(len(pool))
    while len(picked) < min(k, len(pool)):
        picked.setdefault(rng.choices(indices, weights)[0], None)
    order = list(picked)
    rng.shuffle(order)
    return [pool[i] for i in order]
