"""The distillation prompt set's later stages: real prose from pydoc's pages, translations of
the target's sentences and their back-translations; deterministic for a seed."""

from __future__ import annotations

from collections import Counter

from faser.distill.data import TRANSLATED_INTO, back_translation_prompts, real_text_prompts
from faser.distill.generate import _first_sentence

SENTENCES = ["Solar panels turn sunlight into electricity for homes.",
             "Honey bees pollinate many of the crops we eat every day."]


def test_real_text_prompts_are_varied_and_reproducible() -> None:
    prompts = real_text_prompts(SENTENCES, seed=3)
    assert prompts == real_text_prompts(SENTENCES, seed=3)
    categories = Counter(p.category.split(":")[0] for p in prompts)
    assert categories["translation"] == len(SENTENCES)
    assert {"summarization", "rag", "extraction"} <= set(categories)
    assert categories["summarization"] > 50  # pydoc's pages give hundreds of passages
    translations = [p for p in prompts if p.category.startswith("translation:")]
    for p in translations:
        language = p.category.split(":")[1]
        assert language in TRANSLATED_INTO
        assert p.text.startswith(f"Translate English to {language}: ")
    assert sorted(p.text.split(": ", 1)[1] for p in translations) == sorted(SENTENCES)


def test_back_translation_prompts() -> None:
    [prompt] = back_translation_prompts([("German", "Die Sonne scheint.")])
    assert prompt.category == "translation"
    assert prompt.text == "Translate German to English: Die Sonne scheint."


def test_first_sentence_keeps_plain_sentences_only() -> None:
    assert _first_sentence("Bees are small insects that live in hives. They make honey.") == (
        "Bees are small insects that live in hives."
    )
    assert _first_sentence("Short one. Then more.") is None  # under six words
    assert _first_sentence("1. A numbered list item that goes on for a while") is None
