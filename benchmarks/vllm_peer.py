"""vLLM's CPU build on the same token ids, run by benchmarks.engine in vLLM's own venv (it wants
its own torch): `VLLM_PYTHON -m benchmarks.vllm_peer SPEC.json` prints one line `RESULT {json}`
with output tokens/s at each batch size and the seconds to the first token of each long prompt
("prefill N", the median of `repeats`). SPEC: {"model", "dtype", "max_tokens", "batch_sizes",
"prompts": [[token ids], ...], "long_prompts": [[token ids], ...], "repeats"}. Greedy,
ignore_eos, every batch submitted at once; a short warm-up first (vLLM compiles on its first
requests)."""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    # as the engine it is held against: the warm-up and each batch resend the same prompts
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    result = {}
    for batch in spec["batch_sizes"]:
        start = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        result[str(batch)] = sum(len(o.outputs[0].token_ids) for o in outs) / seconds
    first = SamplingParams(temperature=0.0, max_tokens=1)
    for ids in spec.get("long_prompts", []):
        times = []
        for _ in range(spec.get("repeats", 3)):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False)
            times.append(time.perf_counter() - start)
        result[f"prefill {len(ids)}"] = statistics.median(times)
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
