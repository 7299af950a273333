"""The target's own answers to the built-in prompts, generated with the engine's batched decoding.

Records go to a JSON-lines file one chunk at a time, so an interrupted run keeps what it made and
a rerun resumes where it stopped. Every fourth prompt is answered by sampling (temperature 0.8,
seeded) instead of greedily, so the draft also sees states off the target's greedy path. A second
stage asks the target to summarise, extract from and rewrite its own earlier answers; a third asks
terse questions about real prose (pydoc's pages) and to translate sentences of its answers; a
fourth, to translate those translations back into English. Between the second and the third, when
`listed_share` gives them time, the target lists requests users send (sampled, stage 5) and
answers them (stage 6): requests no template has, the way the serving prompts are varied.

With `prompt_files` (faser.distill.prompt_files), the files' prompts replace the built-in
templated requests of the first stage; the later stages run as their shares say, on the answers
to them. A held-out prompt of the files is answered greedily and its answer is never made a
passage of the later stages, so that nothing of it is trained on."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from faser.distill.data import (
    Prompt,
    answer_prompts,
    back_translation_prompts,
    build_prompts,
    listed_requests,
    passage_prompts,
    real_text_prompts,
    request_list_prompts,
)
from faser.distill.prompt_files import read_prompt_files

SAMPLED_EVERY = 4
SAMPLED_TEMPERATURE = 0.8
LIST_TEMPERATURE = 0.7  # greedy lists repeat one item; hotter ones stop reading as requests
LISTS_SHARE = 0.25  # of the listed stages' time, for writing the lists


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    target: str
    num_prompts: int = 512
    max_tokens: int = 192
    chunk_size: int = 16
    time_budget_s: float = 1200.0
    passage_share: float = 0.2  # of the time budget, for the passage stage
    real_text_share: float = 0.0  # of the time budget, for stages 3 and 4 (real prose)
    listed_share: float = 0.0  # of the time budget, for stages 5 and 6 (listed requests)
    num_threads: int = 2
    seed: int = 0
    # JSON-lines prompt files replacing the built-in first stage (faser.distill.prompt_files)
    prompt_files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        shares = (self.passage_share, self.real_text_share, self.listed_share)
        if min(shares) < 0 or sum(shares) > 1:
            raise ValueError(
                "passage_share, real_text_share and listed_share must be >= 0 and sum to <= 1"
            )


def generate_data(config: GenerationConfig, path: Path) -> list[dict]:
    """Fills `path` (JSON lines) with {stage, category, sampled, prompt_ids, response_ids}."""
    from faser import LLM

    first_stage = stage_one_prompts(config)  # before loading the target: a bad file fails fast
    llm = LLM(config.target, num_threads=config.num_threads, max_num_seqs=config.chunk_size)
    deadline = time.monotonic() + config.time_budget_s
    real_text_start = deadline - config.real_text_share * config.time_budget_s
    stage_two_end = real_text_start - config.listed_share * config.time_budget_s
    stage_one_end = stage_two_end - config.passage_share * config.time_budget_s
    _run_stage(llm, first_stage, 1, config, path, stage_one_end)
    greedy = [
        r for r in read_records(path)
        if r["stage"] == 1 and not r["sampled"] and not r.get("held_out")
    ]
    answers = [llm.tokenizer.decode(r["response_ids"], skip_special_tokens=True) for r in greedy]
    passages = [a for a, r in zip(answers, greedy, strict=True) if len(r["response_ids"]) >= 96]
    _run_stage(llm, passage_prompts(passages, config.seed), 2, config, path, stage_two_end)
    lists_end = stage_two_end + LISTS_SHARE * config.listed_share * config.time_budget_s
    if config.listed_share > 0:
        _run_stage(llm, request_list_prompts(), 5, config, path, lists_end)
        listed = [
            request
            for r in read_records(path) if r["stage"] == 5
            for request in listed_requests(
                llm.tokenizer.decode(r["response_ids"], skip_special_tokens=True)
            )
        ]
        _run_stage(llm, answer_prompts(listed, config.seed), 6, config, path, real_text_start)
    if config.real_text_share <= 0:
        return read_records(path)
    sentences = [s for s in map(_first_sentence, answers) if s]
    # a fifth of the stages' time is left for the back-translations, which need stage 3's
    stage_three_end = deadline - 0.2 * config.real_text_share * config.time_budget_s
    _run_stage(llm, real_text_prompts(sentences, config.seed), 3, config, path, stage_three_end)
    translations = [
        (r["category"].split(":")[1],
         llm.tokenizer.decode(r["response_ids"], skip_special_tokens=True).strip())
        for r in read_records(path)
        if r["stage"] == 3 and r["category"].startswith("translation:")
    ]
    _run_stage(llm, back_translation_prompts(translations), 4, config, path, deadline)
    return read_records(path)


def stage_one_prompts(config: GenerationConfig) -> list[Prompt]:
    """The files' prompts when there are any (their first `num_prompts`), else the built-in set."""
    if config.prompt_files:
        return read_prompt_files([Path(p) for p in config.prompt_files], config.num_prompts)
    return build_prompts(config.num_prompts, config.seed)


def _first_sentence(text: str) -> str | None:
    """The answer's first plain sentence of 6 to 30 words, if it has one."""
    first = text.strip().split("\n")[0].split(". ")[0].strip()
    words = first.split()
    return first.rstrip(".") + "." if 6 <= len(words) <= 30 and first[:1].isalpha() else None


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_stage(
    llm, prompts: list[Prompt], stage: int, config: GenerationConfig, path: Path, deadline: float
) -> None:
    start = sum(1 for r in read_records(path) if r["stage"] == stage)
    bar = tqdm(total=len(prompts), initial=start, desc=f"distill: target answers (stage {stage})")
    for first in range(start, len(prompts), config.chunk_size):
        if time.monotonic() >= deadline:
            break
        chunk = prompts[first : first + config.chunk_size]
        records = _generate_chunk(llm, chunk, first, stage, config)
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        bar.update(len(chunk))
        bar.set_postfix(tokens=sum(len(r["response_ids"]) for r in read_records(path)))
    bar.close()


def _generate_chunk(
    llm, chunk: list[Prompt], first: int, stage: int, config: GenerationConfig
) -> list[dict]:
    ids = [_chat_ids(llm.tokenizer, p.text) for p in chunk]
    params = [_params(first + i, stage, config, bool(p.held_out)) for i, p in enumerate(chunk)]
    outputs = llm.generate(ids, params)
    return [
        {
            "stage": stage,
            "category": p.category,
            "sampled": not sp.greedy,
            "prompt_ids": prompt_ids,
            "response_ids": out.token_ids,
            # only a prompt file's prompts carry it (run.py holds the others out by count)
            **({} if p.held_out is None else {"held_out": p.held_out}),
        }
        for p, sp, prompt_ids, out in zip(chunk, params, ids, outputs, strict=True)
    ]


def _params(index: int, stage: int, config: GenerationConfig, held_out: bool = False):
    from faser import SamplingParams

    seed = config.seed * 1_000_003 + stage * 100_000 + index
    if held_out:  # agreement is measured along the target's greedy answers
        return SamplingParams(max_tokens=config.max_tokens, temperature=0.0)
    if stage == 5:  # the request lists: all sampled, so that one prompt gives varied items
        return SamplingParams(max_tokens=config.max_tokens, temperature=LIST_TEMPERATURE, seed=seed)
    if index % SAMPLED_EVERY == SAMPLED_EVERY - 1:
        return SamplingParams(
            max_tokens=config.max_tokens, temperature=SAMPLED_TEMPERATURE, seed=seed
        )
    return SamplingParams(max_tokens=config.max_tokens, temperature=0.0)


def _chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(chat, add_special_tokens=False)
