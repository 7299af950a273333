"""The incremental text equals the whole output's decode at every step, for the tokenizers the
engine meets (byte-level BPE, SentencePiece-style with byte fallback, one that cleans up spaces
before punctuation), and decodes only a window."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from faser.engine.detokenizer import CONTEXT_TOKENS, MAX_BACK_TOKENS, IncrementalText
from tests.fixtures.tiny_models import build_tokenizer

TEXT = (
    "Größe: 3 €, naïve café — 東京 🚀 ok.\n  def f(x):\n\treturn x ** 2  # done!"
    " It is n't so , is it ? I 'm sure . Yes !"
)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's decoding: '▁' for a space, <0xNN> byte pieces, the first leading space cut."""
    pieces = ["▁", "▁the", "▁a", "lo", "é", "▁Hel", "s", "▁▁", "x", ".", "!", "▁'", "t"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def cleaning_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, with the old BERT-era clean-up of spaces before punctuation on decode."""
    tokenizer = build_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    # transformers skips the clean-up for BPE unless told it is meant
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert tokenizer.decode(tokenizer.encode("so , it")) == "so, it"
    return tokenizer


TOKENIZERS = {"byte-level": build_tokenizer, "sentencepiece": sentencepiece_tokenizer,
              "clean-up": cleaning_tokenizer}


def _steps(rng: random.Random, ids: list[int]) -> list[list[int]]:
    """The output as the engine commits it: 1 to 5 tokens a step."""
    out, at = [], 0
    while at < len(ids):
        at += rng.randint(1, 5)
        out.append(ids[:at])
    return out


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_text_is_the_whole_decode_at_every_step(name):
    tokenizer = TOKENIZERS[name]()
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    for trial in range(200):
        if trial % 2:  # any ids: split characters, lone continuation bytes, special tokens
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
        else:  # real text, with runs of special tokens (decoded as nothing) between
            ids = tokenizer.encode(TEXT[rng.randrange(len(TEXT)) :], add_special_tokens=False)
            for _ in range(rng.randint(0, 3)):
                at = rng.randint(0, len(ids))
                ids[at:at] = [rng.choice(special) for _ in range(rng.randint(1, 8))]
        text = IncrementalText()
        for prefix in _steps(rng, ids):
            assert text.decode(tokenizer, prefix) == tokenizer.decode(
                prefix, skip_special_tokens=True), (name, trial, prefix)


def test_each_step_decodes_a_window_not_the_whole_output():
    tokenizer = build_tokenizer()
    decoded: list[int] = []
    calls = tokenizer.decode

    def counted(ids, **kwargs):
        decoded.append(len(ids))
        return calls(ids, **kwargs)

    tokenizer.decode = counted
    ids = tokenizer.encode(TEXT * 8, add_special_tokens=False)
    text = IncrementalText()
    for n in range(1, len(ids) + 1):
        decoded.clear()
        assert text.decode(tokenizer, ids[:n]) == calls(ids[:n], skip_special_tokens=True)
        # one token new, a few settled before it (further back where the window would start
        # inside a character) and at most a split character's bytes unsettled
        assert max(decoded) <= 1 + CONTEXT_TOKENS + MAX_BACK_TOKENS + 3


def test_a_shorter_output_starts_over():
    """A caller that decodes a shorter list (the continuation once decoded the sent part after
    the whole answer's first output) gets its whole decode, and later growth stays right; it
    used to extend the longer call's settled text, and a repeating answer lost characters."""
    tokenizer = build_tokenizer()
    rng = random.Random(1)
    for _ in range(200):
        base = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 4))]
        ids = (base * 60)[: rng.randint(20, 200)]
        cut = rng.randint(1, len(ids) - 10)
        grown = rng.randint(cut + 1, len(ids) - 5)
        text = IncrementalText()
        for prefix in (ids[:grown], ids[:cut], ids[: grown + 2], ids):
            assert text.decode(tokenizer, prefix) == tokenizer.decode(
                prefix, skip_special_tokens=True), (ids, cut, grown, len(prefix))
