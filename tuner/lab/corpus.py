"""Deterministic synthetic text for the lab models, and the prompt sets built from the same grammar.

Predictable text (counting, weekday and month cycles, a fixed cycle of sentences) lets even a small draft
agree with the target; random words do not. The two prompt sets are the lab's workload knob.
"""

from __future__ import annotations

import random

DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
MONTHS = (
    "january", "february", "march", "april", "may", "june", "july",
    "august", "september", "october", "november", "december",
)
SENTENCES = (
    "the quick brown fox jumps over the lazy dog.",
    "a stitch in time saves nine.",
    "the early bird catches the worm.",
    "all that glitters is not gold.",
    "actions speak louder than words.",
    "practice makes perfect.",
    "the pen is mightier than the sword.",
    "when in rome do as the romans do.",
    "fortune favours the bold.",
    "knowledge is power.",
    "time is money.",
    "better late than never.",
)
_SYLLABLES = (
    "ka", "lo", "mi", "ze", "tu", "ra", "po", "ni", "sa", "ve", "qu", "do", "fe", "gi", "ho", "ju",
    "bel", "tor", "min", "sar", "pex", "dul", "wen", "gro", "str", "ax", "ol", "un", "ir", "em",
)


def _word_list(rng: random.Random, n: int = 400) -> list[str]:
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    return sorted(words)


WORDS: tuple[str, ...] = tuple(_word_list(random.Random(1234)))


def counting(rng: random.Random, n: int) -> str:
    start, step = rng.randint(0, 300), rng.choice((1, 1, 1, 2))
    return " ".join(str(start + i * step) for i in range(n))


def cycle(rng: random.Random, items: tuple[str, ...], n: int) -> str:
    start = rng.randrange(len(items))
    return " ".join(items[(start + i) % len(items)] for i in range(n))


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def document(rng: random.Random) -> str:
    """One training document; the mix favours predictable text, as the lab's workloads expect."""
    kind = rng.random()
    if kind < 0.30:
        return "count: " + counting(rng, rng.randint(20, 60))
    if kind < 0.45:
        return "days: " + cycle(rng, DAYS, rng.randint(10, 40))
    if kind < 0.60:
        return "months: " + cycle(rng, MONTHS, rng.randint(10, 40))
    if kind < 0.80:
        return "story: " + cycle(rng, SENTENCES, rng.randint(3, 8))
    return "words: " + random_words(rng, rng.randint(15, 50))


def corpus(seed: int, n_docs: int) -> list[str]:
    rng = random.Random(seed)
    return [document(rng) for _ in range(n_docs)]


def predictable_prompts(seed: int = 7, n: int = 32) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append("count: " + counting(rng, 6))
        elif kind == 1:
            out.append("days: " + cycle(rng, DAYS, 4))
        elif kind == 2:
            out.append("months: " + cycle(rng, MONTHS, 4))
        else:
            out.append("story: " + cycle(rng, SENTENCES, 1))
    return out


def hard_prompts(seed: int = 11, n: int = 32) -> list[str]:
    rng = random.Random(seed)
    return ["words: " + random_words(rng, 8) for _ in range(n)]
