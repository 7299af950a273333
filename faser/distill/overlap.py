"""Near-duplicates between a prompt and a set of reference texts (the benchmark's prompts, which
training prompts must never be): texts are normalised (lower-cased, runs of anything but letters
and digits made one space), then compared as sets of character 8-grams. The references' n-grams
are indexed once, so checking a prompt costs its own n-grams' postings, not a pass over them all.

Two measures: Jaccard (shared n-grams over all of either's) finds a reworded copy; containment
(shared over the smaller set's) finds one text inside another, as a benchmark passage would be
inside a longer training prompt."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

NGRAM = 8
MIN_CONTAINED_NGRAMS = 50  # containment says nothing about texts shorter than ~57 characters


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def ngrams(text: str, n: int = NGRAM) -> frozenset[str]:
    t = normalise(text)
    if len(t) <= n:
        return frozenset([t]) if t else frozenset()
    return frozenset(t[i : i + n] for i in range(len(t) - n + 1))


@dataclass(frozen=True, slots=True)
class Overlap:
    reference: int  # index of the reference text
    jaccard: float
    containment: float  # shared n-grams over the smaller of the two sets


class NgramIndex:
    """The references' n-gram sets, indexed by n-gram."""

    def __init__(self, references: Sequence[str], n: int = NGRAM) -> None:
        self.n = n
        self._normalised = {normalise(t): i for i, t in enumerate(references)}
        self._sizes: list[int] = []
        self._postings: dict[str, list[int]] = {}
        for i, text in enumerate(references):
            grams = ngrams(text, n)
            self._sizes.append(len(grams))
            for gram in grams:
                self._postings.setdefault(gram, []).append(i)

    def exact(self, text: str) -> int | None:
        """The reference equal to `text` once normalised, if any."""
        return self._normalised.get(normalise(text))

    def overlaps(self, text: str) -> list[Overlap]:
        """Every reference sharing an n-gram with `text`, in no particular order."""
        grams = ngrams(text, self.n)
        shared = Counter(chain.from_iterable(self._postings.get(g, ()) for g in grams))
        found = []
        for i, k in shared.items():
            smaller = min(len(grams), self._sizes[i])
            containment = k / smaller if smaller >= MIN_CONTAINED_NGRAMS else 0.0
            found.append(Overlap(i, k / (len(grams) + self._sizes[i] - k), containment))
        return found

    def worst(self, text: str) -> Overlap | None:
        """The reference most like `text` by the larger of the two measures, if any shares one."""
        return max(self.overlaps(text), key=lambda o: max(o.jaccard, o.containment), default=None)
