"""Real text for the draft to learn the target on: what ships with Python itself, so a machine
without a dataset hub still has it. Prose from pydoc's topic pages and the standard library's
long docstrings, code from the standard library's sources.

The target's answers to the built-in prompts are what the draft must guess, but they are few and
templated: a draft trained on them agrees with the target far less on other prompts (Spec-Bench's)
than on held-out ones of its own. Labelled by the target (faser.distill.teacher), real text adds
what the templates lack: varied prose, code and long contexts (sequences of `width` tokens, longer
than any answer); fine-tuning with it raised the teacher-forced agreement on Spec-Bench answers
where the same epochs on the answers alone barely moved it."""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SKIPPED_DIRS = frozenset({"test", "tests", "site-packages", "idlelib", "turtledemo"})
MIN_DOCSTRING_CHARS = 300  # shorter ones are argument lists, not prose


def corpus_records(tokenizer, num_tokens: int, width: int = 1024, seed: int = 0) -> list[dict]:
    """About `num_tokens` tokens, half prose and half code, cut into sequences of `width`
    tokens; records shaped like the answers' (faser.distill.generate), labelled from their
    second token on. Deterministic for a seed and a Python version."""
    if num_tokens <= 0:
        return []
    if width < 2:
        raise ValueError(f"width must be >= 2 tokens, got {width}")
    prose, code = _sources(seed)
    half = num_tokens // 2
    records = []
    for category, texts in (("corpus:prose", prose), ("corpus:code", code)):
        for seq in _sequences(tokenizer, texts, half, width):
            records.append({
                "stage": 0, "category": category, "sampled": True,  # never held out
                "prompt_ids": seq[:1], "response_ids": seq[1:],
            })
    return records


def _sources(seed: int) -> tuple[list[str], list[str]]:
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    files = _stdlib_files()
    rng.shuffle(files)
    prose = [topics[name] for name in sorted(topics)]
    code = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue  # a few stdlib files are templates or in other encodings
        prose.extend(_docstrings(tree))
        code.append(source)
    rng.shuffle(prose)
    return prose, code


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts)
    )


def _docstrings(tree: ast.Module) -> Iterator[str]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            text = ast.get_docstring(node)
            if text and len(text) >= MIN_DOCSTRING_CHARS:
                yield text


def _sequences(tokenizer, texts: list[str], num_tokens: int, width: int) -> Iterator[list[int]]:
    """Texts joined by the end-of-text token and cut into full `width`-token sequences."""
    buffer: list[int] = []
    made = 0
    eos = tokenizer.eos_token_id
    for text in texts:
        buffer += tokenizer(text, add_special_tokens=False)["input_ids"]
        buffer += [eos] if eos is not None else []
        while len(buffer) >= width and made + width <= num_tokens:
            yield buffer[:width]
            buffer, made = buffer[width:], made + width
        if made + width > num_tokens:
            return
