"""A seeded, procedurally generated multi-hop world for training agents on a CPU in minutes.

The world holds fictional entities of six types (person, film, company, university, city,
country) joined by functional relations, so every composed question has exactly one answer::

    film --directed_by--> person --works_for--> company --headquartered_in--> city --in_country--> country
    film --produced_by--> company          person --born_in--> city      person --educated_at--> university
    university --located_in--> city

plus year attributes (birth, release, founding) used by comparison questions.

Passages are titled by their subject entity and state 1..N of its facts in varied sentence
templates. Distractor passages repeat an entity's name next to facts about decoy entities, so
that lexical or dense similarity alone is not enough. With ``alias_share > 0`` some facts name
their object by an alias that no passage links back to the canonical name; only the knowledge
graph knows the alias (through an ``is alias of`` triple), so the hop after such a fact is
reachable through graph retrieval only. The golden trajectory marks that hop's mode ``graph``.

The routing task (``task="routing"``, the learning proof's world) asks one-hop lookups of two
types. ``direct`` questions ask a relation of a film, company, university or city, stated in a
passage titled by its subject: a dense passage search finds it. ``graph_only`` questions ask a
biography fact of a person (``graph_only_relations``: birthplace, employer, university); that
person's facts are stated only in one biography passage, titled by a number, that calls them
"this person". Its OpenIE triples are coreference-resolved (they name the person), so graph
retrieval reaches it from the name while a passage search cannot. What tells the agent which
mode a question needs is the relation it asks about, and a passage search's observation, which
shows the person's name only in passing.

Questions: 1-hop, 2- to 4-hop bridge chains, and comparisons. Each carries the gold answer, gold
passage ids, gold evidence triples and a golden trajectory (sub-query, mode, knowledge base and
intermediate answer per step).

Generation streams: relations are numpy arrays (O(entities)), passages are produced one entity
at a time and written straight to disk by ``write_world``, so a 1M-passage world needs memory
proportional to its entity count plus the ids of the few passages questions point at.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from raggym.atomic import atomic_directory

from .loaders import write_jsonl, write_questions
from .splits import hold_out
from .types import Corpus, Passage, Question

ENTITY_TYPES = ("person", "film", "company", "university", "city", "country")
_TYPE_SHARE = {"person": 0.36, "film": 0.2, "company": 0.14, "university": 0.06, "city": 0.16, "country": 0.08}

# relation name -> (subject type, object type)
RELATIONS: dict[str, tuple[str, str]] = {
    "directed_by": ("film", "person"),
    "produced_by": ("film", "company"),
    "born_in": ("person", "city"),
    "works_for": ("person", "company"),
    "educated_at": ("person", "university"),
    "headquartered_in": ("company", "city"),
    "located_in": ("university", "city"),
    "in_country": ("city", "country"),
}
# year attribute per type (comparison questions)
YEAR_ATTRIBUTE = {"person": "birth_year", "film": "release_year", "company": "founding_year", "university": "founding_year"}
_YEAR_RANGE = {"person": (1900, 2000), "film": (1930, 2024), "company": (1820, 2020), "university": (1200, 1990)}

# How a relation is stated in a passage. {s} subject, {o} object.
_FACT_TEMPLATES = {
    "directed_by": ["{s} was directed by {o}.", "{o} directed {s}.", "The director of {s} is {o}.", "{s} is a film made under the direction of {o}."],
    "produced_by": ["{s} was produced by {o}.", "{o} produced {s}.", "The production company behind {s} was {o}."],
    "born_in": ["{s} was born in {o}.", "{s} is a native of {o}.", "{o} is the birthplace of {s}."],
    "works_for": ["{s} works for {o}.", "{s} is employed by {o}.", "{s} holds a position at {o}."],
    "educated_at": ["{s} studied at {o}.", "{s} is an alumnus of {o}.", "{s} graduated from {o}."],
    "headquartered_in": ["{s} is headquartered in {o}.", "The head office of {s} is in {o}.", "{s} has its headquarters in {o}."],
    "located_in": ["{s} is located in {o}.", "The campus of {s} lies in {o}.", "{s} sits in the city of {o}."],
    "in_country": ["{s} is a city in {o}.", "{s} lies within {o}.", "{s} belongs to the country of {o}."],
    "birth_year": ["{s} was born in the year {o}.", "{s}'s year of birth is {o}."],
    "release_year": ["{s} was released in {o}.", "{s} premiered in {o}."],
    "founding_year": ["{s} was founded in {o}.", "{s} was established in {o}."],
}
# Relation labels as they appear in OpenIE triples.
_TRIPLE_RELATION = {
    "directed_by": "directed by", "produced_by": "produced by", "born_in": "born in", "works_for": "works for",
    "educated_at": "studied at", "headquartered_in": "headquartered in", "located_in": "located in",
    "in_country": "located in country", "birth_year": "born in year", "release_year": "released in year",
    "founding_year": "founded in year",
}
# Noun phrase naming the object of a relation, used to compose multi-hop questions.
_NOUN_PHRASE = {
    "directed_by": ["the director of {x}", "the person who directed {x}"],
    "produced_by": ["the company that produced {x}", "the producer of {x}"],
    "born_in": ["the birthplace of {x}", "the city where {x} was born"],
    "works_for": ["the employer of {x}", "the company that employs {x}"],
    "educated_at": ["the university {x} attended", "the alma mater of {x}"],
    "headquartered_in": ["the city where {x} is headquartered", "the headquarters city of {x}"],
    "located_in": ["the city where {x} is located", "the city that hosts {x}"],
    "in_country": ["the country containing {x}", "the country that contains {x}"],
}
_QUESTION_FORMS = ["What is {np}?", "Name {np}.", "Which entity is {np}?", "Who or what is {np}?"]
_COMPARISON = {
    "person": ("Who was born earlier, {a} or {b}?", "Who was born later, {a} or {b}?"),
    "film": ("Which film came out first, {a} or {b}?", "Which film came out more recently, {a} or {b}?"),
    "company": ("Which company is older, {a} or {b}?", "Which company is younger, {a} or {b}?"),
    "university": ("Which university was founded first, {a} or {b}?", "Which university was founded more recently, {a} or {b}?"),
}
# Routing task: a person's biography that never names the person (module docstring).
_UNNAMED_FACTS = {
    "born_in": ["this person was born in {o}", "this person is a native of {o}"],
    "educated_at": ["this person studied at {o}", "this person graduated from {o}"],
    "works_for": ["this person works for {o}", "this person is employed by {o}"],
    "birth_year": ["this person was born in the year {o}"],
}
_DISTRACTOR_OPENERS = [
    "{e} was mentioned in a regional newsletter alongside {d}.",
    "A documentary about {e} also featured {d}.",
    "Critics have often compared {e} with {d}.",
    "{e} and {d} appeared together in a trade catalogue.",
]

_SYLLABLES = (
    "ka ve lor min tas dor bel ur sa ni qua rem to vi ar el zan pe ko mal ris ten hu ga ost "
    "ly dra fen cor wen bo ith nal ser ju kel ma rin ov ad em"
).split()
_SUFFIX = {
    "city": ["holm", "ford", "vale", "mouth", "burg", "grad", "haven", "port"],
    "country": ["ia", "land", "stan", "ora", "enia", "mark"],
    "company": [" Corp", " Industries", " Labs", " Works", " Group", " Holdings", " Systems"],
    "university": [" University", " Institute", " College", " Polytechnic"],
}
_FILM_WORDS = ("Silent Hollow Crimson Last Paper Winter Glass Distant Iron Velvet Burning Quiet Golden Broken "
               "Northern Hidden Wandering Bitter Lantern River Orchard Harbor Mirror Signal Garden Tide").split()


@dataclass
class WorldConfig:
    """Difficulty knobs of the synthetic world."""

    seed: int = 0
    n_entities: int = 2000
    max_hops: int = 4  # longest bridge chain asked (1..4)
    facts_per_passage: int = 2  # each passage states 1..this many facts of its subject
    distractors_per_fact: float = 0.5  # expected distractor passages per fact passage
    alias_share: float = 0.1  # share of bridge facts whose object is named by an unlinked alias
    n_questions: int = 200
    comparison_share: float = 0.15
    attribute_kb: str = "text"  # "text": years in passages; "table": years only in the table KB
    table_rows: int = 8  # rows per table in the table KB
    # "multihop": the chains and comparisons above. "routing": one-hop lookups where the right
    # retrieval mode depends on the question (module docstring); max_hops, alias_share and
    # comparison_share do not apply to it.
    task: str = "multihop"
    # routing: relations stated only in untitled biography sections that refer to their subject as
    # "this person"; the graph's (coreference-resolved) triples still name it
    graph_only_relations: tuple[str, ...] = ("born_in", "works_for", "educated_at")
    graph_only_share: float = 0.5  # routing: share of questions asking about such a fact

    def __post_init__(self):
        if not 1 <= self.max_hops <= 4:
            raise ValueError(f"max_hops must be 1..4, got {self.max_hops}")
        if self.n_entities < 60:
            raise ValueError(f"n_entities must be at least 60, got {self.n_entities}")
        if self.facts_per_passage < 1:
            raise ValueError("facts_per_passage must be >= 1")
        if not 0 <= self.alias_share <= 1 or not 0 <= self.comparison_share <= 1:
            raise ValueError("alias_share and comparison_share must be in [0, 1]")
        if self.distractors_per_fact < 0:
            raise ValueError("distractors_per_fact must be >= 0")
        if self.attribute_kb not in ("text", "table"):
            raise ValueError(f"attribute_kb must be 'text' or 'table', got {self.attribute_kb!r}")
        if self.task not in ("multihop", "routing"):
            raise ValueError(f"task must be 'multihop' or 'routing', got {self.task!r}")
        self.graph_only_relations = tuple(self.graph_only_relations)
        unknown = [r for r in self.graph_only_relations if r not in RELATIONS]
        if unknown:
            raise ValueError(f"graph_only_relations: unknown relations {unknown}; expected some of {sorted(RELATIONS)}")
        if self.task == "routing":
            if not self.graph_only_relations or any(RELATIONS[r][0] != "person" for r in self.graph_only_relations):
                raise ValueError("routing: graph_only_relations must be non-empty relations of a person (biography "
                                 f"facts); got {self.graph_only_relations}")
        if not 0 <= self.graph_only_share <= 1:
            raise ValueError("graph_only_share must be in [0, 1]")


def entities_for_passages(target_passages: int, config: WorldConfig | None = None) -> int:
    """Rough entity count that yields about ``target_passages`` passages (for scaling runs)."""
    cfg = config or WorldConfig()
    # Measured at the defaults: 2.92 passages per entity with facts_per_passage=2 and 0.5
    # distractors per fact; scale by the two knobs that change it.
    passages_per_entity = 2.92 * (1.5 / ((1 + cfg.facts_per_passage) / 2)) * ((1 + cfg.distractors_per_fact) / 1.5)
    return max(60, int(math.ceil(target_passages / passages_per_entity)))


class _Entities:
    """Entity names, types and relation arrays; everything indexed by a global entity id."""

    def __init__(self, cfg: WorldConfig):
        rng = np.random.default_rng([cfg.seed, 1])
        counts = {t: max(6, int(round(cfg.n_entities * _TYPE_SHARE[t]))) for t in ENTITY_TYPES}
        self.type_of: list[str] = []
        self.ids_by_type: dict[str, np.ndarray] = {}
        start = 0
        for t in ENTITY_TYPES:
            self.ids_by_type[t] = np.arange(start, start + counts[t])
            self.type_of.extend([t] * counts[t])
            start += counts[t]
        self.n = start
        self.names: list[str] = []
        taken: set[str] = set()
        name_rng = random.Random(cfg.seed * 1_000_003 + 7)
        for t in ENTITY_TYPES:
            for _ in range(counts[t]):
                self.names.append(self._fresh_name(t, name_rng, taken))
        self.taken = taken
        self._alias_rng = random.Random(cfg.seed * 1_000_003 + 11)
        # functional relations: subject id -> object id (only for subjects of the right type)
        self.relation: dict[str, np.ndarray] = {}
        for rel, (st, ot) in RELATIONS.items():
            subjects, objects = self.ids_by_type[st], self.ids_by_type[ot]
            self.relation[rel] = objects[rng.integers(0, len(objects), size=len(subjects))]
        self.year = np.zeros(self.n, dtype=np.int32)
        for t, (lo, hi) in _YEAR_RANGE.items():
            ids = self.ids_by_type[t]
            self.year[ids] = rng.integers(lo, hi + 1, size=len(ids))
        self.aliases: dict[int, str] = {}

    @staticmethod
    def _word(rng: random.Random, lo: int, hi: int) -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(lo, hi))).capitalize()

    def _fresh_name(self, etype: str, rng: random.Random, taken: set[str]) -> str:
        for attempt in range(1000):
            extra = attempt // 50  # widen the space if collisions pile up
            if etype == "person":
                name = f"{self._word(rng, 2, 2 + extra)} {self._word(rng, 2, 3 + extra)}"
            elif etype == "film":
                name = f"The {rng.choice(_FILM_WORDS)} {self._word(rng, 2, 3 + extra)}"
            elif etype == "university":
                name = f"{self._word(rng, 2, 3 + extra)}{rng.choice(_SUFFIX['university'])}"
            else:
                name = f"{self._word(rng, 2, 2 + extra)}{rng.choice(_SUFFIX[etype])}"
            if name not in taken:
                taken.add(name)
                return name
        raise RuntimeError("could not find a fresh entity name")  # unreachable in practice

    def subject_index(self, rel: str, entity: int) -> int:
        st = RELATIONS[rel][0]
        return entity - int(self.ids_by_type[st][0])

    def obj(self, rel: str, entity: int) -> int:
        return int(self.relation[rel][self.subject_index(rel, entity)])

    def alias(self, entity: int) -> str:
        if entity not in self.aliases:
            self.aliases[entity] = self._fresh_name(self.type_of[entity], self._alias_rng, self.taken)
        return self.aliases[entity]

    def outgoing(self, etype: str) -> list[str]:
        return [r for r, (st, _) in RELATIONS.items() if st == etype]


_DEPTH = {"country": 0, "city": 1, "company": 2, "university": 2, "person": 3, "film": 4}


@dataclass
class _PlannedQuestion:
    qid: str
    kind: str
    hops: int
    text: str
    answer: str
    facts: list[tuple[int, str]]  # (subject entity, relation or year attribute) in path order
    triples: list[tuple[str, str, str]]
    trajectory: list[dict]
    aliased: set = field(default_factory=set)  # (subject, relation) facts stated with the object's alias


class SyntheticWorld:
    """Plan, then stream, a seeded world. Small worlds can be materialised with ``.corpus`` etc."""

    def __init__(self, config: WorldConfig | None = None, **overrides):
        self.config = config or WorldConfig(**overrides)
        if config is not None and overrides:
            self.config = WorldConfig(**{**asdict(config), **overrides})
        cfg = self.config
        self.entities = _Entities(cfg)
        self._plan_rng = random.Random(cfg.seed * 1_000_003 + 13)
        self._aliased: set[tuple[int, str]] = set()
        self._unnamed: set[int] = set()  # routing: persons whose facts only an unnamed biography states
        self._plans = self._plan_questions()
        self._materialized: tuple[Corpus, dict, Corpus | None, list[Question]] | None = None

    # ------------------------------------------------------------------ question planning
    def _year_kb(self) -> str:
        return "table" if self.config.attribute_kb == "table" else "text"

    def _plan_chain(self, qnum: int, hops: int) -> _PlannedQuestion:
        E, rng = self.entities, self._plan_rng
        start_types = [t for t, d in _DEPTH.items() if d >= hops]
        etype = rng.choice(start_types)
        entity = int(rng.choice(E.ids_by_type[etype]))
        path: list[tuple[int, str]] = []
        current, ctype = entity, etype
        for h in range(hops):
            remaining = hops - h - 1
            options = [r for r in E.outgoing(ctype) if _DEPTH[RELATIONS[r][1]] >= remaining]
            rel = rng.choice(options)
            path.append((current, rel))
            current, ctype = E.obj(rel, current), RELATIONS[rel][1]
        answer = E.names[current]
        noun_phrase = E.names[entity]
        for _, rel in path:
            noun_phrase = rng.choice(_NOUN_PHRASE[rel]).format(x=noun_phrase)
        text = rng.choice(_QUESTION_FORMS).format(np=noun_phrase)
        # Decide which bridge facts name their object by alias (never the last: the answer
        # string must appear verbatim in a gold passage).
        aliased = set()
        for subject, rel in path[:-1]:
            if rng.random() < self.config.alias_share:
                aliased.add((subject, rel))
        triples, trajectory = [], []
        surface = E.names[entity]  # how the agent currently refers to the hop's subject
        via_alias = False
        for subject, rel in path:
            obj = E.obj(rel, subject)
            triples.append((E.names[subject], _TRIPLE_RELATION[rel], E.names[obj]))
            step_np = _NOUN_PHRASE[rel][0].format(x=surface)
            trajectory.append({"query": step_np, "mode": "graph" if via_alias else "passage", "kb": "text", "answer": None})
            via_alias = (subject, rel) in aliased
            surface = E.alias(obj) if via_alias else E.names[obj]
            trajectory[-1]["answer"] = surface
        self._aliased |= aliased
        return _PlannedQuestion(f"syn-{self.config.seed}-{qnum}", "bridge" if hops > 1 else "single", hops, text, answer, path, triples, trajectory, aliased)

    def _plan_comparison(self, qnum: int) -> _PlannedQuestion:
        E, rng = self.entities, self._plan_rng
        etype = rng.choice(list(_COMPARISON))
        ids = E.ids_by_type[etype]
        for _ in range(100):
            a, b = (int(x) for x in rng.sample(list(ids[: min(len(ids), 5000)]), 2))
            if E.year[a] != E.year[b]:
                break
        earlier_form, later_form = _COMPARISON[etype]
        ask_earlier = rng.random() < 0.5
        text = (earlier_form if ask_earlier else later_form).format(a=E.names[a], b=E.names[b])
        first = a if E.year[a] < E.year[b] else b
        winner = first if ask_earlier else (b if first == a else a)
        attr = YEAR_ATTRIBUTE[etype]
        kb = self._year_kb()
        triples = [(E.names[e], _TRIPLE_RELATION[attr], str(int(E.year[e]))) for e in (a, b)]
        trajectory = [
            {"query": f"{attr.replace('_', ' ')} of {E.names[e]}", "mode": "passage", "kb": kb, "answer": str(int(E.year[e]))}
            for e in (a, b)
        ]
        return _PlannedQuestion(f"syn-{self.config.seed}-{qnum}", "comparison", 2, text, E.names[winner], [(a, attr), (b, attr)], triples, trajectory)

    def _plan_routing(self, qnum: int, asked: set) -> _PlannedQuestion:
        """A one-hop lookup (module docstring): about a biography fact of a person
        (``graph_only_relations``, stated only in a section that never names the person), or about
        any other relation, stated in a passage titled by its subject. ``asked``: facts asked so far."""
        cfg, E, rng = self.config, self.entities, self._plan_rng
        graph_only = rng.random() < cfg.graph_only_share
        pool = [r for r in RELATIONS if (r in cfg.graph_only_relations) == graph_only]
        for _ in range(1000):
            rel = rng.choice(pool)
            subject = int(rng.choice(E.ids_by_type[RELATIONS[rel][0]]))
            if (subject, rel) not in asked:
                break
        asked.add((subject, rel))
        if graph_only:
            self._unnamed.add(subject)
        answer = E.names[E.obj(rel, subject)]
        query = _NOUN_PHRASE[rel][0].format(x=E.names[subject])
        text = rng.choice(_QUESTION_FORMS).format(np=rng.choice(_NOUN_PHRASE[rel]).format(x=E.names[subject]))
        return _PlannedQuestion(f"syn-{cfg.seed}-{qnum}", "graph_only" if graph_only else "direct", 1, text, answer,
                                [(subject, rel)], [(E.names[subject], _TRIPLE_RELATION[rel], answer)],
                                [{"query": query, "mode": "graph" if graph_only else "passage", "kb": "text", "answer": answer}])

    def _plan_questions(self) -> list[_PlannedQuestion]:
        cfg, rng = self.config, self._plan_rng
        if cfg.task == "routing":
            asked: set = set()
            return [self._plan_routing(q, asked) for q in range(cfg.n_questions)]
        plans = []
        for q in range(cfg.n_questions):
            if rng.random() < cfg.comparison_share:
                plans.append(self._plan_comparison(q))
            else:
                plans.append(self._plan_chain(q, rng.randint(1, cfg.max_hops)))
        return plans

    # ------------------------------------------------------------------ passage streaming
    def _entity_facts(self, entity: int) -> list[tuple[str, int | None]]:
        """(relation or attribute, object entity or None for years) facts of one entity."""
        E = self.entities
        etype = E.type_of[entity]
        facts: list[tuple[str, int | None]] = [(rel, E.obj(rel, entity)) for rel in E.outgoing(etype)]
        if etype in YEAR_ATTRIBUTE and self.config.attribute_kb == "text":
            facts.append((YEAR_ATTRIBUTE[etype], None))
        return facts

    def iter_passages(self) -> Iterator[tuple[Passage, list[list[str]], list[str], list[tuple[int, str]]]]:
        """Yield ``(passage, triples, entities, facts)`` one passage at a time, in corpus order.

        ``facts`` lists the (subject, relation) facts the passage states, so callers can map
        gold facts to passage ids without keeping the corpus in memory.
        """
        cfg, E = self.config, self.entities
        rng = random.Random(cfg.seed * 1_000_003 + 17)
        for entity in range(E.n):
            facts = self._entity_facts(entity)
            if not facts:
                continue
            rng.shuffle(facts)
            name = E.names[entity]
            if entity in self._unnamed:
                # One passage with all of the person's facts, titled by a number: a
                # coreference-resolving OpenIE (the graph) knows whose they are; the text does not.
                sentences, triples = [], []
                for rel, obj in facts:
                    value = str(int(E.year[entity])) if obj is None else E.names[obj]
                    sentence = rng.choice(_UNNAMED_FACTS[rel]).format(o=value)
                    sentences.append(sentence[0].upper() + sentence[1:] + ".")
                    triples.append([name, _TRIPLE_RELATION[rel], value])
                passage = Passage.from_content(f"Biography no. {entity}", " ".join(sentences))
                yield passage, triples, list(dict.fromkeys([name, *(t[2] for t in triples)])), [(entity, rel) for rel, _ in facts]
                continue
            distractor_texts: set[str] = set()  # a repeated distractor would duplicate a passage id
            i = 0
            while i < len(facts):
                size = rng.randint(1, cfg.facts_per_passage)
                chunk = facts[i : i + size]
                i += size
                sentences, triples, mentioned, stated = [], [], [name], []
                for rel, obj in chunk:
                    if obj is None:
                        value = str(int(E.year[entity]))
                        sentences.append(rng.choice(_FACT_TEMPLATES[rel]).format(s=name, o=value))
                        triples.append([name, _TRIPLE_RELATION[rel], value])
                        mentioned.append(value)
                    else:
                        canonical = E.names[obj]
                        aliased = (entity, rel) in self._aliased
                        shown = E.alias(obj) if aliased else canonical
                        sentences.append(rng.choice(_FACT_TEMPLATES[rel]).format(s=name, o=shown))
                        # An entity linker resolved the alias: the triple names the canonical
                        # entity, and a separate triple records the alias. Only the graph has it.
                        triples.append([name, _TRIPLE_RELATION[rel], canonical])
                        mentioned.append(canonical)
                        if aliased:
                            triples.append([shown, "is alias of", canonical])
                            mentioned.append(shown)
                    stated.append((entity, rel))
                passage = Passage.from_content(name, " ".join(sentences))
                yield passage, triples, list(dict.fromkeys(mentioned)), stated
                # distractors: this entity's name next to a fact about a decoy entity
                n_distractors = int(cfg.distractors_per_fact) + (rng.random() < cfg.distractors_per_fact % 1)
                for _ in range(n_distractors):
                    decoy = rng.randrange(E.n)
                    if decoy == entity:
                        continue
                    # a biography fact must not be repeated, under the person's name, in a distractor
                    decoy_facts = [] if decoy in self._unnamed else self._entity_facts(decoy)
                    opener = rng.choice(_DISTRACTOR_OPENERS).format(e=name, d=E.names[decoy])
                    d_triples = [[name, "mentioned with", E.names[decoy]]]
                    body = ""
                    if decoy_facts:
                        rel, obj = rng.choice(decoy_facts)
                        value = str(int(E.year[decoy])) if obj is None else E.names[obj]
                        body = " " + rng.choice(_FACT_TEMPLATES[rel]).format(s=E.names[decoy], o=value)
                        d_triples.append([E.names[decoy], _TRIPLE_RELATION[rel], value])
                    text = opener + body
                    if text in distractor_texts:
                        continue
                    distractor_texts.add(text)
                    ents = list(dict.fromkeys(x for t in d_triples for x in (t[0], t[2])))
                    yield Passage.from_content(f"{name} (mention)", text), d_triples, ents, []

    def iter_tables(self) -> Iterator[Passage]:
        """Year attributes as small flattened tables (title, header, rows) for the table KB."""
        E, rows = self.entities, self.config.table_rows
        for etype, attr in YEAR_ATTRIBUTE.items():
            ids = E.ids_by_type[etype]
            header = f"name | {attr.replace('_', ' ')}"
            for part, start in enumerate(range(0, len(ids), rows)):
                chunk = ids[start : start + rows]
                title = f"{etype.capitalize()} register, part {part + 1}"
                body = "; ".join(f"{E.names[int(e)]} | {int(E.year[int(e)])}" for e in chunk)
                yield Passage.from_content(title, f"Table: {title}. Columns: {header}. Rows: {body}.")

    def table_passage_for(self) -> dict[int, str]:
        """entity id -> id of the table row passage that holds its year."""
        out: dict[int, str] = {}
        E, rows = self.entities, self.config.table_rows
        it = self.iter_tables()
        for etype in YEAR_ATTRIBUTE:
            ids = E.ids_by_type[etype]
            for start in range(0, len(ids), rows):
                p = next(it)
                for e in ids[start : start + rows]:
                    out[int(e)] = p.id
        return out

    # ------------------------------------------------------------------ assembling questions
    def _questions(self, fact_passage: dict[tuple[int, str], str], table_of: dict[int, str] | None) -> list[Question]:
        out = []
        for plan in self._plans:
            gold = []
            for subject, rel in plan.facts:
                if rel in YEAR_ATTRIBUTE.values() and table_of is not None:
                    gold.append(table_of[subject])
                else:
                    gold.append(fact_passage[(subject, rel)])
            out.append(
                Question(
                    id=plan.qid,
                    question=plan.text,
                    answers=(plan.answer,),
                    gold_passage_ids=tuple(dict.fromkeys(gold)),
                    gold_triples=tuple(plan.triples),
                    hops=plan.hops,
                    kind=plan.kind,
                    golden_trajectory=tuple(plan.trajectory),
                    metadata={"aliased_hops": sum(1 for s in plan.trajectory if s["mode"] == "graph")},
                )
            )
        return out

    def _needed_facts(self) -> set[tuple[int, str]]:
        return {f for plan in self._plans for f in plan.facts}

    def materialize(self):
        if self._materialized is None:
            needed = self._needed_facts()
            passages, docs, fact_passage = [], [], {}
            for p, triples, ents, stated in self.iter_passages():
                passages.append(p)
                docs.append(_openie_doc(len(docs), p, ents, triples))
                for f in stated:
                    if f in needed:
                        fact_passage[f] = p.id
            tables = Corpus(self.iter_tables(), name="synthetic-tables") if self.config.attribute_kb == "table" else None
            table_of = self.table_passage_for() if tables is not None else None
            corpus = Corpus(passages, name=f"synthetic-{self.config.seed}")
            self._materialized = (corpus, {"docs": docs}, tables, self._questions(fact_passage, table_of))
        return self._materialized

    @property
    def corpus(self) -> Corpus:
        return self.materialize()[0]

    @property
    def openie(self) -> dict:
        """Gold triples in the HippoRAG OpenIE output format, aligned with ``corpus`` order."""
        return self.materialize()[1]

    @property
    def table_corpus(self) -> Corpus | None:
        return self.materialize()[2]

    @property
    def questions(self) -> list[Question]:
        return self.materialize()[3]

    def knowledge_bases(self) -> dict[str, Corpus]:
        kbs = {"text": self.corpus}
        if self.table_corpus is not None:
            kbs["table"] = self.table_corpus
        return kbs

    def stats(self) -> dict:
        corpus, openie, tables, questions = self.materialize()
        return _stats(self.config, self.entities, len(corpus), sum(len(d["extracted_triples"]) for d in openie["docs"]),
                      0 if tables is None else len(tables), questions)


def _openie_doc(idx: int, p: Passage, entities: list[str], triples: list[list[str]]) -> dict:
    return {
        "idx": idx,
        "title": p.title,
        "text": p.text,
        "passage": f"{p.title}\n{p.text}",
        "extracted_entities": entities,
        "extracted_triples": triples,
    }


def _stats(cfg: WorldConfig, E: _Entities, n_passages: int, n_triples: int, n_tables: int, questions: list[Question]) -> dict:
    by_kind: dict[str, int] = {}
    by_hops: dict[str, int] = {}
    for q in questions:
        by_kind[q.kind or "?"] = by_kind.get(q.kind or "?", 0) + 1
        by_hops[str(q.hops)] = by_hops.get(str(q.hops), 0) + 1
    return {
        "seed": cfg.seed,
        "entities": E.n,
        "entities_by_type": {t: int(len(E.ids_by_type[t])) for t in ENTITY_TYPES},
        "aliases": len(E.aliases),
        "passages": n_passages,
        "triples": n_triples,
        "tables": n_tables,
        "questions": len(questions),
        "questions_by_kind": dict(sorted(by_kind.items())),
        "questions_by_hops": dict(sorted(by_hops.items())),
        "graph_only_hops": sum(q.metadata.get("aliased_hops", 0) for q in questions),
        "mean_gold_passages": round(sum(len(q.gold_passage_ids) for q in questions) / max(1, len(questions)), 3),
    }


def generate_world(seed: int = 0, **knobs) -> SyntheticWorld:
    """A materialisable world; ``generate_world(0).corpus`` is ready to index."""
    return SyntheticWorld(WorldConfig(seed=seed, **knobs))


def write_world(config: WorldConfig, out_dir: str | os.PathLike, *, corpus_format: str = "jsonl", progress: bool = False,
                heldout: int = 0) -> dict:
    """Stream a world to ``out_dir`` and return its statistics.

    Files: ``corpus.<fmt>`` (the loaders read it), ``openie.json`` (HippoRAG OpenIE format, gold
    triples aligned with corpus order), ``questions.jsonl``, ``tables.jsonl`` (when
    ``attribute_kb='table'``) and ``world.json`` (config and statistics); with ``heldout`` > 0
    also ``train_questions.jsonl`` and ``heldout_questions.jsonl``, the questions split by
    ``raggym.data.splits.hold_out`` under the world's seed (the split the routing demo and study
    train and evaluate on). Everything is written into a temporary sibling directory that is
    renamed into place at the end.
    """
    if corpus_format not in ("jsonl", "json", "parquet"):
        raise ValueError(f"corpus_format must be jsonl, json or parquet, got {corpus_format!r}")
    if not 0 <= heldout <= config.n_questions:
        raise ValueError(f"heldout must be between 0 and the {config.n_questions} questions, got {heldout}")
    started = time.perf_counter()
    with atomic_directory(out_dir) as tmp:
        world = SyntheticWorld(config)
        needed = world._needed_facts()
        fact_passage: dict[tuple[int, str], str] = {}
        n_passages = n_triples = 0
        parquet_writer = None
        batch: list[dict] = []
        corpus_path = tmp / f"corpus.{corpus_format}"
        corpus_fh = None if corpus_format == "parquet" else corpus_path.open("w", encoding="utf-8")
        if corpus_format == "json":
            corpus_fh.write("[")
        openie_fh = (tmp / "openie.json").open("w", encoding="utf-8")
        openie_fh.write('{"docs": [')
        bar = tqdm(desc="synthetic passages", unit="passage", disable=not progress)
        for p, triples, ents, stated in world.iter_passages():
            for f in stated:
                if f in needed:
                    fact_passage[f] = p.id
            doc = json.dumps(_openie_doc(n_passages, p, ents, triples), ensure_ascii=False)
            openie_fh.write(("," if n_passages else "") + "\n" + doc)
            if corpus_format == "parquet":
                batch.append(p.as_dict())
                if len(batch) >= 50_000:
                    parquet_writer = _flush_parquet(corpus_path, parquet_writer, batch)
            else:
                line = json.dumps(p.as_dict(), ensure_ascii=False)
                if corpus_format == "json":
                    corpus_fh.write(("," if n_passages else "") + "\n" + line)
                else:
                    corpus_fh.write(line + "\n")
            n_passages += 1
            n_triples += len(triples)
            bar.update(1)
        bar.close()
        openie_fh.write("\n]}\n")
        openie_fh.close()
        if corpus_format == "parquet":
            parquet_writer = _flush_parquet(corpus_path, parquet_writer, batch)
            if parquet_writer is not None:
                parquet_writer.close()
        else:
            if corpus_format == "json":
                corpus_fh.write("\n]\n")
            corpus_fh.close()
        table_of = None
        n_tables = 0
        if config.attribute_kb == "table":
            tables = list(world.iter_tables())
            write_jsonl(tmp / "tables.jsonl", (t.as_dict() for t in tables))
            n_tables = len(tables)
            table_of = world.table_passage_for()
        questions = world._questions(fact_passage, table_of)
        write_questions(tmp / "questions.jsonl", questions)
        if heldout:
            train_questions, heldout_questions = hold_out(questions, heldout, config.seed)
            write_questions(tmp / "train_questions.jsonl", train_questions)
            write_questions(tmp / "heldout_questions.jsonl", heldout_questions)
        stats = _stats(config, world.entities, n_passages, n_triples, n_tables, questions)
        if heldout:
            stats["split"] = {"train": len(train_questions), "heldout": len(heldout_questions)}
        stats["seconds"] = round(time.perf_counter() - started, 3)
        (tmp / "world.json").write_text(json.dumps({"config": asdict(config), "stats": stats}, indent=2))
    return stats


def _flush_parquet(path: Path, writer, batch: list[dict]):
    schema = pa.schema([("id", pa.string()), ("title", pa.string()), ("text", pa.string())])
    if not batch:
        return writer
    if writer is None:
        writer = pq.ParquetWriter(path, schema)
    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    batch.clear()
    return writer
