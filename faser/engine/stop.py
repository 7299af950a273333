"""When a request is done: EOS, stop tokens, stop strings, max_tokens."""

from __future__ import annotations

from faser.engine.sequence import Sequence


def append_tokens(
    seq: Sequence, token_ids: list[int], eos_token_ids: frozenset[int], tokenizer
) -> list[int]:
    """Appends committed tokens one by one until a stop condition; returns those appended and sets
    seq.finish_reason when the request is done. Tokens past the stop are dropped: they were
    speculated beyond the end."""
    params = seq.params
    appended = []
    for token in token_ids:
        seq.output_token_ids.append(token)
        appended.append(token)
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            seq.finish_reason = "stop"
            break
        if len(seq.output_token_ids) >= params.max_tokens:
            seq.finish_reason = "length"
            break
    if tokenizer is not None:
        _update_text(seq, tokenizer)
    return appended


def _update_text(seq: Sequence, tokenizer) -> None:
    text = seq.detokenizer.decode(tokenizer, seq.output_token_ids)
    for stop in seq.params.stop:
        # search only where a new match can start: text before the last step was already checked
        at = text.find(stop, max(0, len(seq.text) - len(stop)))
        if at != -1:
            seq.text = text[:at]
            seq.finish_reason = "stop"
            return
    seq.text = text
