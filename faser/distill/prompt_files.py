"""Prompt files for `faser distill --prompts`: JSON lines, one {"category": ..., "prompt": ...}
object a line (blank lines skipped). The corpus of real prompts made from public data sets is kept
out of the repository (docs/distill_corpus.md: its sources, licences and where it lies).

Every HELD_OUT_EVERY-th prompt of each file is held out: answered greedily, never trained on, the
draft's agreement on its answers reported at every epoch. It is the file's 2nd, 12th, 22nd, ...
prompt: fixed by the file, not by the seed or by how far a run gets, so runs report comparable
figures; and early, so that a short run (two rounds of the categories) already holds out some of
each category.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from faser.distill.data import Prompt

HELD_OUT_EVERY = 10
KEYS = frozenset({"category", "prompt"})
_CATEGORY = re.compile(r"[a-z][a-z0-9_]*")  # no ":", which the built-in stages' categories use


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and line."""


def read_prompt_files(paths: Sequence[Path], num_prompts: int | None = None) -> list[Prompt]:
    """The files' prompts, categories interleaved (in order of first appearance, each category's
    prompts in file order) so that any prefix is varied; the first `num_prompts` of them."""
    by_category: dict[str, list[Prompt]] = {}
    for path in paths:
        for prompt in read_prompt_file(Path(path)):
            by_category.setdefault(prompt.category, []).append(prompt)
    pools = [list(reversed(pool)) for pool in by_category.values()]
    limit = sum(map(len, pools)) if num_prompts is None else num_prompts
    prompts: list[Prompt] = []
    while len(prompts) < limit and any(pools):
        for pool in pools:
            if pool and len(prompts) < limit:
                prompts.append(pool.pop())
    return prompts


def read_prompt_file(path: Path) -> list[Prompt]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read it ({e})") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            held_out = len(prompts) % HELD_OUT_EVERY == 1
            prompts.append(_parse_line(line, f"{path}:{number}", held_out))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def _parse_line(line: str, where: str, held_out: bool) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(record, dict) or set(record) != KEYS:
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise PromptFileError(f"{where}: expected the keys 'category' and 'prompt', got {got}")
    category, text = record["category"], record["prompt"]
    if not isinstance(category, str) or not _CATEGORY.fullmatch(category):
        raise PromptFileError(
            f"{where}: 'category' must be lower-case letters, digits and '_', got {category!r}"
        )
    if not isinstance(text, str) or not text.strip():
        raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
    return Prompt(category, text, held_out)
