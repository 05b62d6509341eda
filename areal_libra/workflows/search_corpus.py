"""A small deterministic knowledge base and its questions, for Search-R1 on the tiny model.

Every entity is a numbered structure ("bridge 48213") with two facts, each one passage: the year it was
built and its height. A question asks for one fact of one entity; its answer is only in the corpus (a
4-digit year or a 3-digit height cannot be guessed), so an episode succeeds by searching for the entity
and copying the fact out of the retrieved passage. Ids are numbers on purpose: the tiny model's
tokenizer keeps digits as single tokens, so copying an id into the query and a fact into the answer are
symbol-by-symbol copies it can learn (as the calculator task's fixed-width expressions).

The corpus is fixed (CORPUS_SEED, N_ENTITIES): the retrieval server, the warm-up and every dataset seed
share it; a dataset seed only picks which questions are asked."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from areal_libra.workflows.search_markup import SEARCH_INSTRUCTION

CORPUS_SEED = 0
N_ENTITIES = 2000
KINDS = ("bridge", "tower", "station", "library", "harbor", "castle")
RELATIONS = ("built", "tall")  # the fact a question asks for; also the query word that selects its passage
GENERATED_SOURCE = "areal_libra/search"


@dataclass(frozen=True)
class Entity:
    kind: str
    number: int
    year: int
    height: int

    @property
    def name(self) -> str:
        return f"{self.kind} {self.number}"

    def passages(self) -> list[str]:
        return [f"{self.name.capitalize()} was built in {self.year}.",
                f"{self.name.capitalize()} is {self.height} meters tall."]


@dataclass(frozen=True)
class SearchQuestion:
    prompt_id: str
    entity: Entity
    relation: str  # one of RELATIONS

    @property
    def question(self) -> str:
        if self.relation == "built":
            return f"When was {self.entity.name} built?"
        return f"How tall is {self.entity.name} in meters?"

    @property
    def answer(self) -> str:
        return str(self.entity.year if self.relation == "built" else self.entity.height)

    @property
    def query(self) -> str:
        """The query that ranks the answering passage first."""
        return f"{self.entity.name} {self.relation}"


@lru_cache(maxsize=4)
def entities(n: int = N_ENTITIES, seed: int = CORPUS_SEED) -> tuple[Entity, ...]:
    """n entities with distinct 5-digit numbers (never mistaken for a 4-digit year or a 3-digit height),
    identical for the same (n, seed)."""
    if not 0 <= n <= 90_000:
        raise ValueError(f"n must be in [0, 90000], got {n}")
    rng = random.Random(f"areal_libra-search-corpus-{seed}")
    numbers = rng.sample(range(10_000, 100_000), n)
    return tuple(Entity(rng.choice(KINDS), num, rng.randint(1000, 1999), rng.randint(100, 999)) for num in numbers)


def corpus(n: int = N_ENTITIES, seed: int = CORPUS_SEED) -> list[dict[str, str]]:
    """Search-R1's corpus records: {"id", "contents"}, two per entity."""
    return [{"id": str(i), "contents": text}
            for i, text in enumerate(p for e in entities(n, seed) for p in e.passages())]


def generate_questions(n: int, seed: int = 0, id_prefix: str = "search") -> list[SearchQuestion]:
    """n questions about the fixed corpus, identical for the same (n, seed)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    ents = entities()
    rng = random.Random(f"areal_libra-search-questions-{seed}")
    return [SearchQuestion(f"{id_prefix}-{seed}-{i}", rng.choice(ents), rng.choice(RELATIONS)) for i in range(n)]


def question_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SEARCH_INSTRUCTION}, {"role": "user", "content": question}]


def questions_to_rows(questions: list[SearchQuestion]) -> list[dict[str, Any]]:
    return [{"messages": question_messages(q.question), "answer": q.answer, "prompt_id": q.prompt_id,
             "data_source": GENERATED_SOURCE} for q in questions]
