"""Prompt lookup: a guess of a request's next token from an earlier occurrence of its newest
tokens.

A small draft misses where the target copies: names and figures from the prompt, a summary that
quotes its article, a translation that keeps the source's words, a passage said twice. There the
target's next token is usually the one that followed the same few tokens before. Each request
indexes its committed tokens as they come (every n-gram of MIN_N..MAX_N tokens -> the token after
its latest occurrence); the proposer asks for the longest n-gram that ends the context it drafts
from and takes the guess over the draft's own when the guess is likelier to be right.

How likely is learned, not assumed: the acceptance estimator counts how often the guesses taken
over the draft's own were accepted, by n-gram length (faser.spec_decode.estimator), from
PRIOR_PRECISION, since that depends on the model pair and on what is asked. The draft's calibrated
confidence in its own token is the other side of the comparison.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_N, MAX_N = 2, 4
PRIOR_PRECISION = 0.5  # a guess's chance before any of its length is verified


class PromptLookup:
    __slots__ = ("_next", "_num_indexed")

    def __init__(self) -> None:
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> the token after it, latest
        self._num_indexed = 0  # tokens whose preceding n-grams are indexed

    def extend(self, token_ids: Sequence[int]) -> None:
        """Indexes the committed tokens not seen yet: each becomes the guess after the n-grams
        that end just before it. Committed tokens are never taken back, so this only grows."""
        for end in range(max(self._num_indexed, MIN_N), len(token_ids)):
            for n in range(MIN_N, min(MAX_N, end) + 1):
                self._next[tuple(token_ids[end - n : end])] = token_ids[end]
        self._num_indexed = max(self._num_indexed, len(token_ids))

    def guess(self, tail: Sequence[int]) -> tuple[int, int] | None:
        """The token after the longest indexed n-gram that ends `tail` (the newest tokens of
        the context, drafted ones included) and that n-gram's length; None when no n-gram of it
        occurred before."""
        for n in range(min(MAX_N, len(tail)), MIN_N - 1, -1):
            token = self._next.get(tuple(tail[len(tail) - n :]))
            if token is not None:
                return token, n
        return None
