"""A request's text, grown by decoding its newest tokens instead of its whole output every step.

Decoding the whole output at every step costs time in proportion to its length, for every request
of the batch, step after step: quadratic in an answer's length. Instead each step decodes a short
window, the new tokens with a few settled ones before them as context (a tokenizer may print a
token differently at the start of a text, e.g. without its leading space), and appends what the
window adds to the context's own decode. A decode that ends in U+FFFD (an incomplete UTF-8
character that the next token may complete) is not settled: the next step decodes those tokens
again. The window starts earlier where its context would not decode to the settled text's end
(a window that starts inside a character: SentencePiece's byte pieces decode as a group, all of
it U+FFFD when any is incomplete) or to fewer than a few characters (special tokens decode to
nothing, and the clean-up of spaces before punctuation rewrites across the join); where no such
window extends its context, the whole output is decoded, as before. The tests hold the text
equal to the whole output's decode at every step for byte-level and SentencePiece-style
tokenizers, and for one that cleans up spaces before punctuation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONTEXT_TOKENS = 4  # settled tokens decoded again before the new ones, as context
MAX_BACK_TOKENS = 8  # how much further back a window may start: two characters of byte tokens
# the least text a context must decode to: a clean-up of spaces rewrites up to ` n't` at a join
MIN_CONTEXT_CHARS = 4
REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class IncrementalText:
    """The decode of a request's first `num_settled` output tokens, and that count."""

    settled_text: str = ""
    num_settled: int = 0

    def decode(self, tokenizer: Any, token_ids: list[int]) -> str:
        """The text of `token_ids` (the output so far: the last call's tokens and new ones; a
        shorter list is decoded whole and starts over)."""
        if len(token_ids) < self.num_settled:
            self.settled_text, self.num_settled = "", 0
        text = self._extend(tokenizer, token_ids)
        if text is None:
            text = _decode(tokenizer, token_ids)
        if not text.endswith(REPLACEMENT_CHAR):
            self.settled_text, self.num_settled = text, len(token_ids)
        return text

    def _extend(self, tokenizer: Any, token_ids: list[int]) -> str | None:
        """The settled text and what the new tokens add to it, from the first window whose
        context decodes to the settled text's end; None where none does."""
        first = max(0, self.num_settled - CONTEXT_TOKENS)
        for start in range(first, max(0, first - MAX_BACK_TOKENS) - 1, -1):
            context = _decode(tokenizer, token_ids[start : self.num_settled])
            # a shorter context (special tokens decode to nothing) would leave the new tokens at
            # a text's start, or out of reach of a clean-up that spans the join
            long_enough = len(context) >= MIN_CONTEXT_CHARS or start == 0
            if long_enough and self.settled_text.endswith(context):
                window = _decode(tokenizer, token_ids[start:])
                if not window.startswith(context):
                    return None
                return self.settled_text + window[len(context) :]
        return None


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""
