"""A request's text per step: the whole output decoded again (the way before) against the
window of faser.engine.detokenizer, with the target's tokenizer, one token a step.

Texts: Spec-Bench's prompts run together (English, code, some German and French), and a text of
CJK characters and emoji, whose tokens often end inside a character. Each figure is the median
of interleaved repeats of a whole answer's steps, divided by its steps; every step's text is
checked equal to the whole decode's. Usage:
  python -m benchmarks.detokenize [--lengths 128,512,2048] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from benchmarks.common import DEFAULT_PROMPTS, interleaved, print_table, timed
from faser.engine.detokenizer import IncrementalText
from faser.models.resolver import resolve_model

WIDE_TEXT = "東京は日本の首都です。人口は約千四百万人。🚀🎉 Größe naïve — ✓ 数学と物理。"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="the target (default: the embedded default)")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--lengths", default="128,512,2048", help="output tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def texts(prompts: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    return {"spec-bench": "\n\n".join(r["turns"][0] for r in rows), "cjk+emoji": WIDE_TEXT * 200}


def whole(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]


def window(tokenizer, ids: list[int]) -> list[str]:
    text = IncrementalText()
    return [text.decode(tokenizer, ids[:n]) for n in range(1, len(ids) + 1)]


def main() -> None:
    args = parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model, "target"))
    lengths = [int(n) for n in args.lengths.split(",")]
    runs, cases = {}, []
    for name, text in texts(args.prompts).items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        for n in lengths:
            if len(ids) < n:
                raise ValueError(f"{name}: {len(ids)} tokens, fewer than {n}")
            part = ids[:n]
            if whole(tokenizer, part) != window(tokenizer, part):
                raise AssertionError(f"{name}, {n} tokens: the window's text differs")
            cases.append((name, n))
            for way, decode in (("whole", whole), ("window", window)):
                runs[(name, n, way)] = lambda d=decode, p=part: timed(lambda: d(tokenizer, p))
    times = interleaved(runs, args.repeats)
    rows = [[name, n, times[(name, n, "whole")] / n * 1e6, times[(name, n, "window")] / n * 1e6,
             times[(name, n, "whole")] / times[(name, n, "window")]] for name, n in cases]
    print_table(f"Microseconds per request and step, median of {args.repeats} (texts equal at "
                "every step)", ["text", "output tokens", "whole", "window", "speed-up"], rows)
    if args.json:
        records = [{"text": r[0], "output_tokens": r[1], "whole_us": r[2], "window_us": r[3]}
                   for r in rows]
        args.json.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
