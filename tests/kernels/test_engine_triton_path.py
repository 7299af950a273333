"""The engine through the Triton kernels gives the same tokens as through the PyTorch twins.

Run on a CPU under Triton's interpreter, in a fresh process (Triton picks its mode once per
process, see triton_mode.py): `python tests/kernels/test_engine_triton_path.py` builds tiny
random-weight models, runs the engine with FASER_KERNELS=torch and with FASER_KERNELS=triton
(the dispatchers read it on every call) and compares their tokens; it also checks that a
decode batch padded the way the CUDA graphs pad it (faser.runner.cuda_graphs, replayed eagerly)
gives the unpadded batch's logits and leaves the KV cache as the unpadded batch does."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 31))]
MAX_TOKENS = 8
# (policy, frontier size): plain decoding, classic draft-then-verify, frontiers with pruning
RUNS = [("off", None), ("fixed:3", None), ("fixed:3", 2)]


def test_engine_tokens_same_through_triton_interpreter():
    pytest.importorskip("triton")
    from triton_mode import run_fresh

    done = run_fresh([str(Path(__file__).relative_to(REPO))], interpret=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["runs"] == len(RUNS) + 1  # + the sampled run
    assert report["graph_padding"] == "ok"


# -- the fresh process ------------------------------------------------------------------------


def _generate(target: Path, draft: Path, kernels: str, policy: str, frontier: int | None,
              params) -> list[list[int]]:
    from faser import LLM, SpecConfig

    os.environ["FASER_KERNELS"] = kernels
    llm = LLM(str(target), draft_model=str(draft), num_kv_blocks=48, block_size=4,
              spec=SpecConfig(policy=policy, frontier_size=frontier), dtype="float32")
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    return [o.token_ids for o in outputs]


def _compare_engine(target: Path, draft: Path) -> int:
    from faser import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=s,
                              ignore_eos=True) for s in range(len(PROMPTS))]
    runs = [(p, f, greedy) for p, f in RUNS] + [("fixed:3", None, sampled)]
    for policy, frontier, params in runs:
        twin = _generate(target, draft, "torch", policy, frontier, params)
        triton = _generate(target, draft, "triton", policy, frontier, params)
        if twin != triton:
            raise AssertionError(f"{policy} (frontier {frontier}): twin {twin} != triton {triton}")
        assert all(len(t) == MAX_TOKENS for t in twin)
    return len(runs)


def _check_graph_padding(target: Path) -> None:
    """Three one-token requests padded to a graph size of 4, replayed eagerly."""
    from faser.models.loader import load_model
    from faser.runner.batch import Chunk, build_batch
    from faser.runner.cuda_graphs import DecodeGraphs
    from faser.runner.model_runner import ModelRunner

    os.environ["FASER_KERNELS"] = "triton"
    model = load_model(target, "cpu", "float32", 64)
    plain, padded = (ModelRunner(model, 16, 4, "cpu") for _ in range(2))
    graphs = DecodeGraphs(model, padded.kv_caches, max_batch=4, max_blocks_per_seq=6,
                          device="cpu", capture=False)
    tables = [[1, 2], [3], [4, 5, 6]]
    prefill = [Chunk(list(range(1, 6)), 0, tables[0], 1), Chunk([7, 8], 0, tables[1], 1),
               Chunk(list(range(10, 19)), 0, tables[2], 1)]
    decode = [Chunk([9], 5, tables[0], 1), Chunk([3], 2, tables[1], 1),
              Chunk([4], 9, tables[2], 1)]
    for runner in (plain, padded):
        runner.forward(prefill)
    # an earlier, larger batch leaves a live request's slot in the static buffers' padding row:
    # the padding must write nothing there
    graphs.slot_mapping[3], graphs.input_ids[3], graphs.seq_lens[3] = 4, 50, 3
    batch = build_batch(decode, 4, "cpu")
    assert graphs.fits(batch)
    expected = plain.forward(decode)
    with torch.inference_mode():
        got = model.compute_logits(graphs.run(batch))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # a GEMM over 4 rows may round apart from one over 3 (the BLAS may pick its kernel by row
    # count); a padding row written into the live slot would differ by the size of the values
    for (k0, v0), (k1, v1) in zip(plain.kv_caches, padded.kv_caches, strict=True):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)
    assert not graphs.fits(build_batch([Chunk([1, 2], 0, [1], 1)], 4, "cpu"))  # two tokens


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run me with TRITON_INTERPRET=1 (Triton's interpreter)")
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    from tests.engine.tiny import make_checkpoint, make_noisy_copy

    with tempfile.TemporaryDirectory() as tmp:
        target = make_checkpoint(Path(tmp) / "target", "gqa_tied")
        draft = make_noisy_copy(target, Path(tmp) / "draft", noise=0.12)
        runs = _compare_engine(target, draft)
        _check_graph_padding(target)
    print(json.dumps({"runs": runs, "graph_padding": "ok"}))


if __name__ == "__main__":
    main()
