"""A request's target features: the target's last hidden state h_p by position p, written by every
target forward and kept until a feature draft (faser.models.feature_draft) has read them.

The draft feeds position p with h_{p-1}, so at a proposal it reads up to h_{n-2} of a request with n
committed tokens: rows the target computed for committed tokens. Rows computed for rejected draft
tokens are overwritten when the target next runs from that position, before anyone reads them.
A request keeps its rows through the steps it does not draft (the faser controller is off), so its
draft resumes over the target's features, not zeros; only policy `off`'s requests, which never
draft, keep none. Rows cost hidden_size values a token, a small fraction of its KV cache."""

from __future__ import annotations

import torch


class TargetFeatures:
    """Rows h_start .. h_{end-1} in a buffer that grows by doubling: appended to every step and,
    while a request does not speculate, never read, they would otherwise be copied whole at each
    write (a request 1,000 tokens in copied 7 MB a step to append 7 KB)."""

    __slots__ = ("_buffer", "_first", "_num", "start")

    def __init__(self) -> None:
        self.start = 0  # position of rows[0]
        self._buffer: torch.Tensor | None = None  # [capacity, hidden]
        self._first = 0  # the buffer's row that holds h_start
        self._num = 0

    @property
    def rows(self) -> torch.Tensor | None:  # [num_positions, hidden]
        if self._buffer is None:
            return None
        return self._buffer[self._first : self._first + self._num]

    @property
    def end(self) -> int:
        return self.start + self._num

    def write(self, pos: int, rows: torch.Tensor) -> None:
        """h_pos, h_{pos+1}, ...; whatever was held from pos on is replaced. Positions between
        what is held and pos (the target ran them in steps that kept no rows) read as zero, and
        the rows before them stay: a prompt's rows outlive a few steps in which its request did
        not draft. A forward that starts before what is held (a preempted request's recompute)
        starts afresh."""
        if self._buffer is None or pos < self.start:
            self.start, self._first, self._num = pos, 0, 0
        kept = pos - self.start
        self._reserve(kept + rows.shape[0], min(kept, self._num), rows)
        at = self._first + kept
        if kept > self._num:  # a gap: positions the target ran while no row was kept
            self._buffer[self._first + self._num : at] = 0
        self._buffer[at : at + rows.shape[0]] = rows.detach()
        self._num = kept + rows.shape[0]

    def read(self, first: int, last: int, zero: torch.Tensor) -> torch.Tensor:
        """h_first .. h_{last-1}. A position not held reads as `zero` ([hidden]): position -1
        (before the first token), and those the target ran while the request did not speculate
        (its features were not kept); the draft then guesses from the tokens alone there."""
        held = self.rows
        if held is None:
            return zero.expand(max(0, last - first), -1).clone()
        lo, hi = max(first, self.start), min(last, self.end)
        if lo == first and hi == last:
            return held[lo - self.start : hi - self.start]
        out = held.new_zeros(max(0, last - first), held.shape[1])
        if lo < hi:
            out[lo - first : hi - first] = held[lo - self.start : hi - self.start]
        return out

    def row(self, pos: int) -> torch.Tensor | None:
        """A copy of h_pos, when held."""
        held = self.rows
        if held is None or not self.start <= pos < self.end:
            return None
        return held[pos - self.start].clone()

    def forget_before(self, pos: int) -> None:
        """Drops h_p for p < pos: the draft will never read them again."""
        if self._buffer is not None and pos > self.start:
            drop = min(pos, self.end) - self.start
            self._first, self._num = self._first + drop, self._num - drop
            self.start += drop

    def _reserve(self, num: int, kept: int, like: torch.Tensor) -> None:
        """Room for `num` rows from `_first`, of which the first `kept` are kept."""
        buffer = self._buffer
        if buffer is not None and buffer.dtype == like.dtype and buffer.device == like.device:
            if self._first + num <= buffer.shape[0]:
                return
            if num <= buffer.shape[0] // 2:  # room enough once the forgotten rows are gone
                buffer[:kept] = buffer[self._first : self._first + kept].clone()
                self._first = 0
                return
        grown = like.new_empty((max(16, 2 * num), like.shape[1]))
        if buffer is not None and kept:
            grown[:kept] = buffer[self._first : self._first + kept]
        self._buffer, self._first = grown, 0
