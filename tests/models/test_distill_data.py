"""The distillation prompt set's later stages: real prose from pydoc's pages, translations of
the target's sentences and their back-translations, and the requests the target lists;
deterministic for a seed."""

from __future__ import annotations

from collections import Counter

import pytest

from faser.distill.data import (
    REQUEST_LISTS,
    SUBJECTS,
    TOPICS,
    TRANSLATED_INTO,
    answer_prompts,
    back_translation_prompts,
    listed_requests,
    real_text_prompts,
    request_list_prompts,
)
from faser.distill.generate import GenerationConfig, _first_sentence

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


def test_listed_requests_keep_numbered_requests_once() -> None:
    text = (
        "Here are 8 questions people often ask about cooking:\n\n"
        "1. What's a good recipe for a vegan lasagna?\n"
        '2. "How do you make bread without yeast?"\n'
        "3. What's a good recipe for a vegan lasagna?\n"  # a repeat
        "4) Why does pasta water need salt?\n"
        "5. Too short\n"
        "6. **List 8 questions people often ask about cooking**\n"  # an echo, in markup
        "7. List 8 questions people often ask about cooking\n"
        "These are just a few examples."
    )
    assert listed_requests(text) == [
        "What's a good recipe for a vegan lasagna?",
        "How do you make bread without yeast?",
        "Why does pasta water need salt?",
    ]


def test_answer_prompts_are_distinct_and_reproducible() -> None:
    requests = ["How do tides work?", "how do tides work?", "Name three rivers in Africa."]
    prompts = answer_prompts(requests, seed=1)
    assert prompts == answer_prompts(requests, seed=1)
    assert sorted(p.text for p in prompts) == ["How do tides work?", "Name three rivers in Africa."]
    assert {p.category for p in prompts} == {"listed"}


def test_request_list_prompts_cover_every_subject_and_template() -> None:
    prompts = request_list_prompts()
    assert len(prompts) == len(set(p.text for p in prompts))
    assert len(prompts) == len(REQUEST_LISTS) * (len(SUBJECTS) + len(TOPICS))
    assert all(p.category == "request_list" and p.text.startswith("List 8 ") for p in prompts)


def test_generation_shares_must_fit_the_budget() -> None:
    with pytest.raises(ValueError, match="listed_share"):
        GenerationConfig(target="t", passage_share=0.5, listed_share=0.6)
    with pytest.raises(ValueError, match="sum to <= 1"):
        GenerationConfig(target="t", real_text_share=-0.1)
    GenerationConfig(target="t", passage_share=0.0, listed_share=1.0)
