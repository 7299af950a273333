"""A request's target features: the target's last hidden state h_p by position p, written by every
target forward and kept until a feature draft (faser.models.feature_draft) has read them.

The draft feeds position p with h_{p-1}, so at a proposal it reads up to h_{n-2} of a request with n
committed tokens: rows the target computed for committed tokens. Rows computed for rejected draft
tokens are overwritten when the target next runs from that position, before anyone reads them."""

from __future__ import annotations

import torch


class TargetFeatures:
    __slots__ = ("rows", "start")

    def __init__(self) -> None:
        self.start = 0  # position of rows[0]
        self.rows: torch.Tensor | None = None  # [num_positions, hidden]

    @property
    def end(self) -> int:
        return self.start + (0 if self.rows is None else self.rows.shape[0])

    def write(self, pos: int, rows: torch.Tensor) -> None:
        """h_pos, h_{pos+1}, ...; whatever was held from pos on is replaced. A forward that
        starts before what is held (a preempted request's recompute) or past its end starts
        afresh."""
        rows = rows.detach().clone()  # not a view that would keep the whole batch alive
        if self.rows is None or not self.start <= pos <= self.end:
            self.start, self.rows = pos, rows
            return
        self.rows = torch.cat((self.rows[: pos - self.start], rows))

    def read(self, first: int, last: int) -> torch.Tensor:
        """h_first .. h_{last-1}; position -1 (before the first token) reads zeros."""
        lead = max(0, -first)
        first += lead
        if self.rows is None or first < self.start or last > self.end:
            raise RuntimeError(
                f"target features of positions [{first}, {last}) are not held "
                f"(held: [{self.start}, {self.end}))"
            )
        held = self.rows[first - self.start : last - self.start]
        return torch.cat((held.new_zeros(lead, held.shape[1]), held)) if lead else held

    def forget_before(self, pos: int) -> None:
        """Drops h_p for p < pos: the draft will never read them again."""
        if self.rows is not None and pos > self.start:
            drop = min(pos, self.end) - self.start
            self.rows, self.start = self.rows[drop:], self.start + drop
