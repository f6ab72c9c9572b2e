"""A seeded synthetic world: the embedded default dataset of ray_credit.

:func:`make_world` invents countries, cities, people, organizations and inventions with
made-up names (built from syllables), gives them attributes (years, professions, crafts,
industries, languages) and relations (``born_in``, ``located_in``, ``founded_by``,
``headquartered_in``, ``invented_by``, ``married_to``, ``mentor_of``), and writes:

* a corpus in the FlashRAG / Search-R1 format, one document per entity
  (``{"id": "17", "contents": "<name>\\n<text>"}``) whose text states the entity's facts
  with varied wording, plus distractors: people and cities named like others (same given
  name, surname differing in one syllable), sentences about other places, years and
  people in every document, and event documents that mention many entities but answer
  nothing;
* single-hop questions (``"In which city was Talvo Brenik born?"``) and two-hop questions
  (``"In which year was the founder of Quessa Works born?"``), each with its gold answers
  and the ids of the documents that support it, in hop order.

Every answer is a fictional name, a random year or an attribute drawn near-uniformly from
a dozen or more values, so a question cannot be answered without retrieval. The same
seed gives the same world, byte for byte.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ray_credit.config import check_fields

__all__ = ["World", "WorldConfig", "make_world"]


@dataclass(frozen=True)
class WorldConfig:
    """How big a world to make and how hard to make retrieval. Defaults: ~300 entities."""

    seed: int = 0
    """Seed of everything: the same config gives the same world, byte for byte."""
    num_entities: int = 300
    """Countries + cities + people + organizations + inventions (at least 20)."""
    country_fraction: float = 0.06
    """Share of the entities that are countries (at least 2 countries)."""
    city_fraction: float = 0.18
    """Share that are cities (at least one per country; one of them is its capital)."""
    organization_fraction: float = 0.16
    """Share that are organizations (each founded by a person, headquartered in a city)."""
    artifact_fraction: float = 0.12
    """Share that are inventions (each invented by a person); people are the rest."""
    num_questions: int = 1000
    """Questions to ask, at most: a small world has fewer distinct facts than this."""
    two_hop_fraction: float = 0.5
    """Share of the questions that need two documents; if the world has fewer 2-hop facts,
    1-hop questions fill the rest."""
    three_hop_fraction: float = 0.0
    """Share of the questions that need three documents, each naming the next (an
    invention's inventor's birth city's country); neither of the first two holds the
    answer. If the world has fewer 3-hop facts, 1-hop questions fill the rest."""
    namesake_fraction: float = 0.2
    """Share of people and cities named after another one (same given name, surname or
    city name differing in one syllable): retrieval by name alone picks the wrong one."""
    spouse_fraction: float = 0.6
    """Share of people who are married (to another person of the world)."""
    mentor_fraction: float = 0.5
    """Share of people who had a mentor (an older person of the world)."""
    event_doc_fraction: float = 0.2
    """Distractor documents about events (fairs, congresses), per entity: each mentions
    several people, a city, an invention and an organization but states none of their facts."""

    def __post_init__(self) -> None:
        check_fields(self)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(
                    f"WorldConfig.{f.name} must be a finite number, got {value} "
                    f"(default {f.default})"
                )
        if self.num_entities < 20:
            raise ValueError(f"num_entities must be >= 20, got {self.num_entities}")
        if self.num_questions < 0:
            raise ValueError(f"num_questions must be >= 0, got {self.num_questions}")
        kinds = (
            self.country_fraction,
            self.city_fraction,
            self.organization_fraction,
            self.artifact_fraction,
        )
        if min(kinds) <= 0 or sum(kinds) >= 0.9:
            raise ValueError(
                "country/city/organization/artifact fractions must be > 0 and sum to < 0.9 "
                f"(people are the rest), got {kinds}"
            )
        for name in ("two_hop_fraction", "three_hop_fraction", "namesake_fraction",
                     "spouse_fraction"):  # fmt: skip
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.two_hop_fraction + self.three_hop_fraction > 1.0:
            raise ValueError(
                f"two_hop_fraction + three_hop_fraction must be <= 1 (1-hop questions are "
                f"the rest), got {self.two_hop_fraction} + {self.three_hop_fraction}"
            )
        if not 0.0 <= self.mentor_fraction <= 1.0 or self.event_doc_fraction < 0:
            raise ValueError(
                "mentor_fraction must be in [0, 1] and event_doc_fraction >= 0, got "
                f"{self.mentor_fraction} and {self.event_doc_fraction}"
            )


@dataclass(frozen=True)
class World:
    """A generated world: its corpus and its questions.

    ``corpus``: ``{"id", "contents"}`` documents (title line, then text).
    ``questions``: ``{"id", "question", "golden_answers", "data_source"
    ("synthetic_1hop" | "synthetic_2hop" | "synthetic_3hop"), "supporting_doc_ids" (hop
    order), "hops",
    "reference_plan" (None: Search-P1's plans are made by the pipeline)}``.
    """

    corpus: list[dict] = field(repr=False)
    questions: list[dict] = field(repr=False)

    def __repr__(self) -> str:
        hops = [q["hops"] for q in self.questions]
        three = f", {hops.count(3)} 3-hop" if 3 in hops else ""
        return (
            f"World(docs={len(self.corpus)}, questions={len(self.questions)}: "
            f"{hops.count(1)} 1-hop, {hops.count(2)} 2-hop{three})"
        )

    def split(self, *, eval_fraction: float = 0.1, seed: int = 0) -> tuple[list[dict], list[dict]]:
        """Train and held-out questions: disjoint, deterministic, stratified by ``data_source``.

        Each source contributes ``round(eval_fraction * its count)`` held-out questions;
        both lists keep the world's order.
        """
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        rng = random.Random(f"ray_credit-split-{seed}")
        held_out: set[int] = set()
        for source in sorted({q["data_source"] for q in self.questions}):
            rows = [i for i, q in enumerate(self.questions) if q["data_source"] == source]
            held_out.update(rng.sample(rows, round(eval_fraction * len(rows))))
        train = [q for i, q in enumerate(self.questions) if i not in held_out]
        test = [q for i, q in enumerate(self.questions) if i in held_out]
        return train, test

    def write(
        self, folder: str | os.PathLike, *, eval_fraction: float = 0.1, seed: int = 0
    ) -> dict[str, Path]:
        """Write ``corpus.jsonl``, ``train.parquet`` and ``test.parquet`` into ``folder``.

        The parquet files have Search-R1's columns (``question``, ``golden_answers``,
        ``data_source``) plus ``id``, ``supporting_doc_ids`` and ``hops``; the split is
        :meth:`split` with the same arguments. Returns ``{"corpus", "train", "test"}`` paths.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {
            "corpus": folder / "corpus.jsonl",
            "train": folder / "train.parquet",
            "test": folder / "test.parquet",
        }
        with paths["corpus"].open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(doc, ensure_ascii=False) + "\n" for doc in self.corpus)
        schema = pa.schema(
            [
                ("id", pa.string()),
                ("question", pa.string()),
                ("golden_answers", pa.list_(pa.string())),
                ("data_source", pa.string()),
                ("supporting_doc_ids", pa.list_(pa.string())),
                ("hops", pa.int64()),
                ("reference_plan", pa.list_(pa.string())),
            ]
        )
        for name, rows in zip(
            ("train", "test"), self.split(eval_fraction=eval_fraction, seed=seed), strict=True
        ):
            table = pa.Table.from_pylist(rows, schema=schema)
            pq.write_table(table, paths[name])
        return paths


# ----------------------------------------------------------------------------- names
def _words(text: str, sep: str | None = None) -> tuple[str, ...]:
    return tuple(text.split(sep))


# Single consonants weigh double: clusters make names harder to say.
_ONSETS = _words("b d f g h k l m n p r s t v z b d f g k l m n p r s t v z br dr gr kr tr th st")
_VOWELS = _words("a e i o u a e i o u a e o ia ei")
_CODAS = _words("n r l s k m th x nd rk ss")
_CITY_SUFFIXES = _words("mere ford holm wick vale dal burg port")
# Real places and famous names the syllables can spell; none of them may name an entity.
_REAL_NAMES = frozenset(
    _words(
        "paris roma rome lima milan boston sofia kobe dakar nara pisa riga baku doha bern oslo "
        "sparta troy gaza kiev minsk tomsk perm osaka kyoto delhi tokyo seoul hanoi tirana "
        "sana pune dubai nice vienna venice genoa turin malta cuba peru chad mali kenya nepal "
        "tonga samoa fiji lagos accra kano jena ulm gotha"
    )
)


def _syllable(rng: random.Random, closed: bool) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + (rng.choice(_CODAS) if closed else "")


class _Names:
    """Unique made-up words: no word is a substring of another, so a name found in a
    document (normalized, as substring EM does) is that entity's name and no other's."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.words: set[str] = set()
        self.joined = "|"

    def _free(self, word: str) -> bool:
        low = word.lower()
        if low in _REAL_NAMES or low in self.joined:
            return False
        return not any(
            low[i:j] in self.words
            for i in range(len(low))
            for j in range(i + 4, len(low) + 1)
            if j - i < len(low)
        )

    def _take(self, make: Callable[[], list[str]], tries: int) -> list[str] | None:
        for _ in range(tries):
            syllables = make()
            word = "".join(syllables)
            if self._free(word):
                self.words.add(word.lower())
                self.joined += word.lower() + "|"
                return syllables
        return None

    def new(
        self, closed: float = 0.5, suffixes: Sequence[str] = (), suffix_p: float = 0.0
    ) -> list[str]:
        """A fresh word of 2 or 3 syllables (the last one maybe closed, then maybe a suffix)."""

        def make() -> list[str]:
            parts = [_syllable(self.rng, False) for _ in range(self.rng.choice((1, 1, 1, 2)))]
            parts.append(_syllable(self.rng, self.rng.random() < closed))
            if self.rng.random() < suffix_p:
                parts.append(self.rng.choice(suffixes))
            return parts

        syllables = self._take(make, tries=1000)
        if syllables is None:
            raise RuntimeError("could not invent a new name in 1000 tries: the world is too big")
        return syllables

    def near(self, syllables: list[str]) -> list[str] | None:
        """A fresh word that differs from ``syllables`` in its last syllable (or suffix), or
        ``None`` when the few such words are all taken."""
        if syllables[-1] in _CITY_SUFFIXES:
            return self._take(lambda: [*syllables[:-1], self.rng.choice(_CITY_SUFFIXES)], 20)
        return self._take(
            lambda: [*syllables[:-1], _syllable(self.rng, self.rng.random() < 0.7)], 20
        )


def _word(syllables: list[str]) -> str:
    return "".join(syllables).capitalize()


# -------------------------------------------------------------------------- entities
PROFESSIONS = _words(
    "astronomer cartographer glassblower botanist architect clockmaker physician engineer "
    "sculptor chemist shipwright violinist printer weaver jeweler surveyor"
)
CRAFTS = _words(
    "glassmaking|shipbuilding|silk weaving|clockmaking|pottery|bookbinding|lace making|"
    "brewing|tanning|bell founding|rope making|paper making|dyeing|wood carving|"
    "cheese making|salt mining",
    "|",
)
INDUSTRIES = _words(
    "textiles|shipping|publishing|banking|mining|railways|insurance|pharmaceuticals|"
    "glassware|timber|ceramics|telegraphy|chemicals|canned food",
    "|",
)
_ORG_NOUNS = _words("Company Works Group Holdings Consortium Trust Partners Union Brothers")
_DEVICES = _words(
    "Engine Loom Lens Compass Pump Lamp Clock Turbine Sextant Kiln Valve Dynamo Press Telescope"
)
_EVENTS = _words("Exhibition Fair Congress Regatta Festival Symposium")


@dataclass(eq=False)
class _Entity:
    kind: str  # person | city | country | organization | artifact
    name: str
    facts: dict[str, Any] = field(default_factory=dict)
    doc_id: str = ""

    @property
    def aliases(self) -> list[str]:
        """Gold answers naming this entity: a person also by the surname alone."""
        surname = self.facts.get("surname")
        return [self.name, surname] if surname else [self.name]


def _balanced(rng: random.Random, options: Sequence[Any], n: int) -> list[Any]:
    """``n`` picks that use every option equally often (±1), in random order."""
    options = list(options)
    rng.shuffle(options)
    picks = [options[i % len(options)] for i in range(n)]
    rng.shuffle(picks)
    return picks


def _make_entities(config: WorldConfig, rng: random.Random) -> dict[str, list[_Entity]]:
    n = config.num_entities
    n_countries = max(2, round(n * config.country_fraction))
    n_cities = max(n_countries, round(n * config.city_fraction))
    n_orgs = max(1, round(n * config.organization_fraction))
    n_artifacts = max(1, round(n * config.artifact_fraction))
    n_people = n - n_countries - n_cities - n_orgs - n_artifacts
    names = _Names(rng)
    countries, cities = _make_places(config, rng, names, n_countries, n_cities)
    people = _make_people(config, rng, names, cities, n_people)
    # Founders and inventors spread over everyone: no person is a majority answer.
    creators = iter(_balanced(rng, people, n_orgs + n_artifacts))
    orgs = [
        _Entity(
            "organization",
            f"{_word(names.new(0.7))} {rng.choice(_ORG_NOUNS)}",
            {"founder": next(creators), "hq": hq, "industry": industry},
        )
        for hq, industry in zip(
            _balanced(rng, cities, n_orgs), _balanced(rng, INDUSTRIES, n_orgs), strict=True
        )
    ]
    artifacts = [
        _Entity(
            "artifact",
            f"{_word(names.new(0.7))} {rng.choice(_DEVICES)}",
            {"inventor": next(creators), "demo_city": city},
        )
        for city in _balanced(rng, cities, n_artifacts)
    ]
    for creation, year_key in [(o, "founded_year") for o in orgs] + [
        (a, "year") for a in artifacts
    ]:
        creator = creation.facts.get("founder") or creation.facts["inventor"]
        creation.facts[year_key] = creator.facts["birth_year"] + rng.randint(20, 34)
        creator.facts.setdefault("created", []).append(creation)
    return {
        "country": countries,
        "city": cities,
        "person": people,
        "organization": orgs,
        "artifact": artifacts,
    }


def _make_places(
    config: WorldConfig, rng: random.Random, names: _Names, n_countries: int, n_cities: int
) -> tuple[list[_Entity], list[_Entity]]:
    """Countries (capital, language, independence year) and their cities."""
    countries = [
        _Entity(
            "country",
            _word(names.new(0.6, ("ia",), 0.3)),
            {"language": _word(names.new(0.8)), "independence_year": rng.randint(1600, 1950)},
        )
        for _ in range(n_countries)
    ]
    city_syllables: list[list[str]] = []
    for _ in range(n_cities):
        namesake = city_syllables and rng.random() < config.namesake_fraction
        near = names.near(rng.choice(city_syllables)) if namesake else None
        city_syllables.append(near or names.new(0.6, _CITY_SUFFIXES, 0.35))
    cities = [
        _Entity(
            "city",
            _word(syllables),
            {"founded_year": rng.randint(800, 1650), "craft": craft, "country": country},
        )
        for syllables, craft, country in zip(
            city_syllables,
            _balanced(rng, CRAFTS, n_cities),
            _balanced(rng, countries, n_cities),
            strict=True,
        )
    ]
    for country in countries:
        own = [c for c in cities if c.facts["country"] is country]
        country.facts["capital"] = own[0]
        country.facts["towns"] = own[1:3]
        own[0].facts["capital_of"] = country
    return countries, cities


def _make_people(
    config: WorldConfig, rng: random.Random, names: _Names, cities: list[_Entity], n: int
) -> list[_Entity]:
    """People with birth and death years, a birth city, a profession, spouses and mentors."""
    people: list[_Entity] = []
    for birth_city, profession in zip(
        _balanced(rng, cities, n), _balanced(rng, PROFESSIONS, n), strict=True
    ):
        surname = None
        if people and rng.random() < config.namesake_fraction:
            twin = rng.choice(people).facts
            given, surname = twin["given"], names.near(twin["surname_syllables"])
        if surname is None:
            given, surname = _word(names.new(0.4)), names.new(0.8)
        born = rng.randint(1650, 1930)
        facts = {
            "given": given,
            "surname": _word(surname),
            "surname_syllables": surname,
            "pronoun": rng.choice(("He", "She")),
            "birth_year": born,
            "death_year": born + rng.randint(35, 95),
            "birth_city": birth_city,
            "profession": profession,
        }
        people.append(_Entity("person", f"{given} {_word(surname)}", facts))
    _link_people(config, rng, people)
    return people


def _link_people(config: WorldConfig, rng: random.Random, people: list[_Entity]) -> None:
    """Marriages (birth years within 15) and mentors (15 to 45 years older, <= 2 students)."""
    single = [p for p in people if rng.random() < config.spouse_fraction]
    rng.shuffle(single)
    while len(single) >= 2:
        a = single.pop()
        match = next(
            (b for b in single if abs(b.facts["birth_year"] - a.facts["birth_year"]) <= 15), None
        )
        if match is not None:
            single.remove(match)
            a.facts["spouse"], match.facts["spouse"] = match, a
    for student in people:
        if rng.random() >= config.mentor_fraction:
            continue
        born = student.facts["birth_year"]
        mentors = [
            p
            for p in people
            if 15 <= born - p.facts["birth_year"] <= 45 and len(p.facts.get("students", [])) < 2
        ]
        if mentors:
            mentor = rng.choice(mentors)
            student.facts["mentor"] = mentor
            mentor.facts.setdefault("students", []).append(student)


# ------------------------------------------------------------------------- documents
# Fact sentences, several wordings each: {s} is the subject (its name, or a pronoun /
# "The city" after the first sentence), {name} its name, {v} the value, {av} "a"/"an" + value.
_FACTS: dict[str, tuple[str, ...]] = {
    "person.birth_city": (
        "{s} was born in {v}.",
        "{s} was a native of {v}.",
        "{s} was born and raised in the city of {v}.",
    ),
    "person.birth_year": (
        "{s} was born in the year {v}.",
        "{s} came into the world in {v}.",
        "{s} was born in {v}.",
    ),
    "person.death_year": ("{s} died in {v}.", "{s} passed away in {v}.", "{s} lived until {v}."),
    "person.profession": (
        "{s} worked as {av}.",
        "{s} earned a living as {av}.",
        "{s} was {av} by profession.",
    ),
    "person.spouse": ("{s} was married to {v}.", "{s} married {v}.", "{s} and {v} were married."),
    "person.mentor": (
        "{s} studied under {v}.",
        "{s} was mentored by {v}.",
        "{s} trained as an apprentice of {v}.",
    ),
    "person.students": ("{s} mentored {v}.", "{s} took on {v} as an apprentice."),
    "person.created": ("{s} is remembered as the creator of {v}.", "{s} was behind {v}."),
    "city.country": ("{s} is a city in {v}.", "{s} lies in {v}.", "{s} is located in {v}."),
    "city.founded_year": (
        "{s} was founded in {v}.",
        "{s} was settled in {v}.",
        "{s} received its charter in {v}.",
    ),
    "city.craft": (
        "{s} is known for its {v}.",
        "{s} is famous for {v}.",
        "{s} has long been a centre of {v}.",
    ),
    "city.capital_of": ("{s} is the capital of {v}.", "{s} serves as the capital of {v}."),
    "country.capital": ("{s} has its capital in {v}.", "The capital of {name} is {v}."),
    "country.language": (
        "{s} has {v} as its official language.",
        "Most people in {name} speak {v}.",
        "The official language of {name} is {v}.",
    ),
    "country.independence_year": (
        "{s} became independent in {v}.",
        "{s} gained its independence in {v}.",
        "{s} declared independence in {v}.",
    ),
    "country.towns": ("Other towns of {name} include {v}.", "{s} also has the towns {v}."),
    "organization.founder": (
        "{s} was founded by {v}.",
        "The founder of {name} was {v}.",
        "{s} was started by {v}.",
    ),
    "organization.founded_year": (
        "{s} was established in {v}.",
        "{s} dates back to {v}.",
        "{s} opened its doors in {v}.",
    ),
    "organization.hq": (
        "{s} is headquartered in {v}.",
        "The headquarters of {name} are in {v}.",
        "{s} has its main offices in {v}.",
    ),
    "organization.industry": (
        "{s} works in {v}.",
        "{s} is active in {v}.",
        "The main business of {name} is {v}.",
    ),
    "artifact.inventor": (
        "{s} was invented by {v}.",
        "{s} is the work of the inventor {v}.",
        "Credit for the {name} goes to {v}.",
    ),
    "artifact.year": (
        "{s} was invented in {v}.",
        "{s} dates from {v}.",
        "The first {name} was built in {v}.",
    ),
    "artifact.demo_city": (
        "{s} was first demonstrated in {v}.",
        "{s} was first shown to the public in {v}.",
        "The first public demonstration of the {name} took place in {v}.",
    ),
}
# Distractors: true-sounding sentences about other places, people and years.
_NOISE: dict[str, tuple[str, ...]] = {
    "person": (
        "{s} travelled to {city} in {year}.",
        "{s} spent several years in {city}.",
        "{s} corresponded with {person} for many years.",
        "{s} gave a public lecture in {city} in {year}.",
    ),
    "city": (
        "{s} lies a day's journey from {city}.",
        "{s} was badly damaged by a flood in {year}.",
        "A road links {name} with {city}.",
    ),
    "country": ("{s} signed a trade treaty in {year}.", "{s} hosted {person} in {year}."),
    "organization": (
        "{s} opened a branch in {city} in {year}.",
        "{s} competed with {org} for many years.",
        "{s} hired {person} as an adviser in {year}.",
    ),
    "artifact": (
        "A copy of the {name} was exhibited in {city} in {year}.",
        "{person} later improved the {name}.",
        "{s} was widely used by {profession}s.",
    ),
}
_REFERENCES = {
    "city": ("The city",),
    "country": ("The country",),
    "organization": ("The company",),
    "artifact": ("The invention",),
}


def _text(value: Any) -> str:
    if isinstance(value, _Entity):
        return f"the {value.name}" if value.kind == "artifact" else value.name
    if isinstance(value, list):
        names = [_text(v) for v in value]
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return str(value)


def _subject(entity: _Entity, rng: random.Random, first: bool) -> str:
    name = f"The {entity.name}" if entity.kind == "artifact" else entity.name
    if first:
        return name
    if entity.kind == "person":
        return rng.choice((name, entity.facts["surname"], entity.facts["pronoun"]))
    return rng.choice((name, *_REFERENCES[entity.kind]))


def _entity_doc(entity: _Entity, rng: random.Random, pools: dict[str, list[_Entity]]) -> str:
    """The entity's document: every fact once, in random order and wording, plus noise."""
    facts = [
        (key, value)
        for key, value in entity.facts.items()
        if f"{entity.kind}.{key}" in _FACTS and value not in (None, [])
    ]
    rng.shuffle(facts)
    sentences = []
    for i, (key, value) in enumerate(facts):
        template = rng.choice(_FACTS[f"{entity.kind}.{key}"])
        v = _text(value)
        article = "an" if v[0] in "aeiou" else "a"
        sentences.append(
            template.format(
                s=_subject(entity, rng, first=i == 0), name=entity.name, v=v, av=f"{article} {v}"
            )
        )
    # Noise years fall in the entity's lifetime: after its first year, before any death.
    first = min(v for k, v in entity.facts.items() if k.endswith("year"))
    last = max(first + 10, entity.facts.get("death_year", 1990))
    related = [entity, *(v for v in entity.facts.values() if isinstance(v, _Entity))]
    for template in rng.sample(_NOISE[entity.kind], rng.randint(1, 2)):
        slots = {
            "s": _subject(entity, rng, first=False),
            "name": entity.name,
            "year": rng.randint(first + 10, last),
            "profession": rng.choice(PROFESSIONS),
        }
        for slot, kind in (("city", "city"), ("person", "person"), ("org", "organization")):
            if f"{{{slot}}}" not in template:
                continue
            other = next(
                (e for e in rng.choices(pools[kind], k=20) if all(e is not r for r in related)),
                None,
            )
            if other is None:
                break  # a tiny world: no one else to mention
            slots[slot] = other.name
        else:
            sentences.insert(rng.randint(1, len(sentences)), template.format(**slots))
    return entity.name + "\n" + " ".join(sentences)


def _event_doc(rng: random.Random, pools: dict[str, list[_Entity]]) -> tuple[str, str]:
    """A distractor: names people, a city, an invention and a company; answers nothing."""
    city, org, artifact = (rng.choice(pools[k]) for k in ("city", "organization", "artifact"))
    guests = rng.sample(pools["person"], 3)
    kind, year = rng.choice(_EVENTS), rng.randint(1700, 1990)
    title = f"{city.name} {kind} of {year}"
    sentences = [
        rng.choice(("The {t} was held in {c}.", "{c} hosted the {t}.")),
        rng.choice(("Among its guests were {g}.", "{g} attended.", "Visitors included {g}.")),
        rng.choice(("{p} gave a talk on the {a} there.", "The {a} was shown by {p}.")),
        rng.choice(("The {k} was sponsored by {o}.", "{o} paid for the {k}.")),
    ]
    text = " ".join(sentences).format(
        t=title,
        c=city.name,
        y=year,
        g=_text(guests),
        p=guests[0].name,
        a=artifact.name,
        k=kind.lower(),
        o=org.name,
    )
    return title, f"{title}\n{text[0].upper()}{text[1:]}"


# ------------------------------------------------------------------------- questions
# (subject kind, relation path, wordings). One relation: a 1-hop question answered by the
# subject's document; two: a 2-hop question through the entity the first one names.
_QUESTIONS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("person", ("birth_city",), ("In which city was {x} born?", "Which city was {x} born in?")),
    ("person", ("birth_year",), ("In which year was {x} born?", "When was {x} born?")),
    ("person", ("death_year",), ("In which year did {x} die?", "When did {x} die?")),
    (
        "person",
        ("profession",),
        ("What was the profession of {x}?", "What did {x} do for a living?"),
    ),
    ("person", ("spouse",), ("Who was {x} married to?", "Who was the spouse of {x}?")),
    ("person", ("mentor",), ("Who was the mentor of {x}?", "Under whom did {x} study?")),
    ("city", ("country",), ("In which country is {x}?", "Which country is {x} located in?")),
    ("city", ("founded_year",), ("In which year was {x} founded?", "When was {x} founded?")),
    ("city", ("craft",), ("What is {x} known for?", "Which craft is the city of {x} famous for?")),
    ("country", ("capital",), ("What is the capital of {x}?",)),
    ("country", ("language",), ("What is the official language of {x}?",)),
    ("country", ("independence_year",), ("In which year did {x} become independent?",)),
    ("organization", ("founder",), ("Who founded {x}?", "Who was the founder of {x}?")),
    ("organization", ("founded_year",), ("In which year was {x} established?",)),
    ("organization", ("hq",), ("In which city is {x} headquartered?",)),
    ("organization", ("industry",), ("In which industry does {x} work?",)),
    ("artifact", ("inventor",), ("Who invented the {x}?",)),
    ("artifact", ("year",), ("In which year was the {x} invented?",)),
    ("artifact", ("demo_city",), ("In which city was the {x} first demonstrated?",)),
    ("organization", ("founder", "birth_year"), ("In which year was the founder of {x} born?",)),
    ("organization", ("founder", "birth_city"), ("In which city was the founder of {x} born?",)),
    ("organization", ("hq", "country"), ("In which country is {x} headquartered?",)),
    (
        "person",
        ("birth_city", "country"),
        ("Which country is the city where {x} was born in?", "In which country was {x} born?"),
    ),
    (
        "person",
        ("birth_city", "founded_year"),
        ("In which year was the birthplace of {x} founded?",),
    ),
    ("person", ("spouse", "profession"), ("What was the profession of the spouse of {x}?",)),
    ("person", ("spouse", "birth_year"), ("In which year was the spouse of {x} born?",)),
    ("person", ("mentor", "birth_city"), ("In which city was the mentor of {x} born?",)),
    ("artifact", ("inventor", "birth_year"), ("In which year was the inventor of the {x} born?",)),
    (
        "artifact",
        ("inventor", "profession"),
        ("What was the profession of the inventor of the {x}?",),
    ),
    ("artifact", ("demo_city", "country"), ("In which country was the {x} first demonstrated?",)),
    ("city", ("country", "capital"), ("What is the capital of the country in which {x} lies?",)),
    ("city", ("country", "language"), ("What language is spoken in the country where {x} lies?",)),
)


# Three relations: a 3-hop question, each document naming the entity the next one is
# about. Asked only with WorldConfig.three_hop_fraction > 0 (their wordings draw from a
# random stream of their own, so a world without them is the same as before they existed).
_QUESTIONS_3HOP: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("artifact", ("inventor", "birth_city", "country"),
     ("In which country was the inventor of the {x} born?",)),
    ("organization", ("founder", "birth_city", "country"),
     ("In which country was the founder of {x} born?",)),
    ("person", ("spouse", "birth_city", "country"),
     ("In which country was the spouse of {x} born?",)),
    ("person", ("mentor", "birth_city", "country"),
     ("In which country was the mentor of {x} born?",)),
    ("organization", ("hq", "country", "capital"),
     ("What is the capital of the country where {x} is headquartered?",)),
    ("artifact", ("demo_city", "country", "capital"),
     ("What is the capital of the country where the {x} was first demonstrated?",)),
    ("person", ("birth_city", "country", "language"),
     ("What language is spoken in the country where {x} was born?",)),
    ("artifact", ("inventor", "spouse", "profession"),
     ("What was the profession of the spouse of the inventor of the {x}?",)),
    ("organization", ("founder", "spouse", "birth_year"),
     ("In which year was the spouse of the founder of {x} born?",)),
)  # fmt: skip


def _candidates(
    entities: dict[str, list[_Entity]],
    docs: dict[str, str],
    rng: random.Random,
    templates: Sequence[tuple[str, tuple[str, ...], tuple[str, ...]]] = _QUESTIONS,
) -> list[dict]:
    """Every question of ``templates`` the world can answer, kept only if its text does
    not contain a gold answer and (2- and 3-hop) no document before the last does: every
    hop must be needed."""
    from ray_credit.qa import normalize_answer

    out = []
    for kind, path, wordings in templates:
        for subject in entities[kind]:
            chain, value = [subject], subject
            for relation in path:
                value = value.facts.get(relation)
                if value is None:
                    break
                chain.append(value)
            if value is None:
                continue
            golds = value.aliases if isinstance(value, _Entity) else [str(value)]
            question = rng.choice(wordings).format(x=subject.name)
            normalized, asked = [normalize_answer(g) for g in golds], normalize_answer(question)
            if any(g in asked for g in normalized):
                continue
            before_last = [docs[e.doc_id] for e in chain[: len(path) - 1]]
            if any(g in doc for doc in before_last for g in normalized):
                continue
            out.append(
                {
                    "template": (kind, path),
                    "question": question,
                    "golden_answers": golds,
                    "data_source": f"synthetic_{len(path)}hop",
                    "supporting_doc_ids": [e.doc_id for e in chain[: len(path)]],
                    "hops": len(path),
                }
            )
    return out


def _spread_sample(rng: random.Random, candidates: list[dict], n: int) -> list[dict]:
    """``n`` candidates: as many of each template as a uniform sample takes, and within a
    template a round robin over the answers, so no answer dominates any template."""
    quota = Counter(c["template"] for c in rng.sample(candidates, n))
    by_template: dict[Any, list[dict]] = {}
    for candidate in candidates:
        by_template.setdefault(candidate["template"], []).append(candidate)
    picked = []
    for template, group in by_template.items():
        rng.shuffle(group)
        seen: Counter[str] = Counter()
        ranked = []
        for candidate in group:
            answer = candidate["golden_answers"][0]
            ranked.append((seen[answer], candidate))
            seen[answer] += 1
        ranked.sort(key=lambda pair: pair[0])  # stable: the shuffle breaks ties
        picked += [candidate for _, candidate in ranked[: quota[template]]]
    return picked


def make_world(config: WorldConfig | None = None, **overrides: Any) -> World:
    """Generate the synthetic world of ``config`` (default :class:`WorldConfig`).

    ``overrides`` replace config fields: ``make_world(seed=3, num_entities=100)``.
    Generation is pure Python and takes a few tens of milliseconds for the default size.
    """
    from dataclasses import fields, replace

    if config is not None and not isinstance(config, WorldConfig):
        raise TypeError(
            f"make_world takes a WorldConfig (or None for the default), got "
            f"{type(config).__name__}; pass fields as keywords: make_world(seed=3)"
        )
    config = config or WorldConfig()
    unknown = set(overrides) - {f.name for f in fields(WorldConfig)}
    if unknown:
        valid = ", ".join(f.name for f in fields(WorldConfig))
        raise TypeError(f"unknown WorldConfig field(s) {sorted(unknown)}; valid fields: {valid}")
    config = replace(config, **overrides)

    entities = _make_entities(config, random.Random(f"ray_credit-world-{config.seed}"))
    rng = random.Random(f"ray_credit-docs-{config.seed}")
    contents = [
        _entity_doc(entity, rng, entities) for group in entities.values() for entity in group
    ]
    events: dict[str, str] = {}  # by title: two events never share one
    while len(events) < round(config.event_doc_fraction * config.num_entities):
        title, text = _event_doc(rng, entities)
        events.setdefault(title, text)
    contents += events.values()
    order = list(range(len(contents)))
    rng.shuffle(order)  # ids say nothing about an entity's kind
    doc_ids = {position: str(doc_id) for doc_id, position in enumerate(order)}
    for position, entity in enumerate(e for group in entities.values() for e in group):
        entity.doc_id = doc_ids[position]
    corpus = [{"id": str(i), "contents": contents[position]} for i, position in enumerate(order)]

    from ray_credit.qa import normalize_answer

    normalized_docs = {doc["id"]: normalize_answer(doc["contents"]) for doc in corpus}
    rng = random.Random(f"ray_credit-questions-{config.seed}")
    candidates = _candidates(entities, normalized_docs, rng)
    by_hops = [[c for c in candidates if c["hops"] == hops] for hops in (1, 2)]
    three: list[dict] = []
    if config.three_hop_fraction > 0:  # a stream of their own: see _QUESTIONS_3HOP
        rng3 = random.Random(f"ray_credit-questions-3hop-{config.seed}")
        by_three = _candidates(entities, normalized_docs, rng3, _QUESTIONS_3HOP)
        n_three = min(len(by_three), round(config.num_questions * config.three_hop_fraction))
        three = _spread_sample(rng3, by_three, n_three)
    n_two = min(len(by_hops[1]), round(config.num_questions * config.two_hop_fraction))
    n_one = min(len(by_hops[0]), config.num_questions - n_two - len(three))
    questions = _spread_sample(rng, by_hops[0], n_one) + _spread_sample(rng, by_hops[1], n_two)
    questions += three
    rng.shuffle(questions)
    for q in questions:
        del q["template"]
    questions = [
        {"id": f"synthetic-{config.seed}-{i:05d}", **q, "reference_plan": None}
        for i, q in enumerate(questions)
    ]
    return World(corpus=corpus, questions=questions)
