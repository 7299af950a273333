"""The engine on CUDA: models on the GPU, the Triton kernels, rejection inputs on the logits'
device; greedy output equal to Hugging Face's own generate (on the CPU) under every option:
eager, CUDA graphs, torch.compile. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from faser import LLM, SamplingParams, SpecConfig

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [60] * 17]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def cuda_llm(models, shape: str, spec: SpecConfig, draft: str | None = None, **kwargs) -> LLM:
    # fp32: the oracle runs in fp32 on the CPU, and the Triton attention is IEEE in fp32
    return LLM(
        str(models[shape]), draft_model=str(models[draft or f"{shape}_draft"]), spec=spec,
        device="cuda", dtype="float32", num_kv_blocks=96, block_size=4, **kwargs,
    )


@CUDA
@pytest.mark.parametrize("policy", ["off", "fixed:3", "faser"])
@pytest.mark.parametrize("shape", ["gqa_tied", "mha_untied"])
def test_greedy_matches_hf_generate_on_cuda(tiny_models, hf_greedy, tmp_path, shape, policy):
    spec = SpecConfig(policy=policy, profile_cache_dir=str(tmp_path))
    llm = cuda_llm(tiny_models, shape, spec)
    assert next(llm.engine.pair.target.parameters()).is_cuda
    assert llm.engine.target.kv_caches[0][0].is_cuda
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(shape, prompt, MAX_TOKENS)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@CUDA
def test_frontiers_prune_on_cuda(tiny_models, hf_greedy):
    llm = cuda_llm(tiny_models, "gqa_tied", SpecConfig(policy="fixed:6", frontier_size=2))
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    assert llm.engine.stats.num_pruned_positions > 0


@CUDA
@pytest.mark.parametrize("options", [{"cuda_graphs": True}, {"compile": True},
                                     {"cuda_graphs": True, "compile": True}], ids=str)
def test_options_keep_greedy_output(tiny_models, hf_greedy, options):
    llm = cuda_llm(tiny_models, "gqa_tied", SpecConfig(policy="fixed:3"), max_num_seqs=8,
                   **options)
    if options.get("cuda_graphs"):
        assert llm.engine.target.graphs is not None and llm.engine.target.graphs.graphs
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)
    # plain decoding (every forward graphed once the prompts are in)
    outputs = llm.generate(PROMPTS, GREEDY, speculation={"policy": "off"})
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy("gqa_tied", prompt, MAX_TOKENS)


@CUDA
def test_draft_equal_to_target_accepts_everything(tiny_models):
    llm = cuda_llm(tiny_models, "gqa_tied", SpecConfig(policy="fixed:4"), draft="gqa_tied")
    llm.generate(PROMPTS, GREEDY)
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


@CUDA
def test_sampled_requests_on_cuda_are_reproducible(tiny_models):
    """Sampled rejection on the GPU (q rows, uniforms from each request's CPU generator)."""
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=20, seed=s,
                             ignore_eos=True) for s in range(len(PROMPTS))]
    runs = []
    for _ in range(2):
        llm = cuda_llm(tiny_models, "gqa_tied", SpecConfig(policy="fixed:3"))
        runs.append([o.token_ids for o in llm.generate(PROMPTS, params)])
    assert runs[0] == runs[1]
    assert all(len(t) == 16 for t in runs[0])


def test_cuda_graphs_need_cuda():
    from faser.config import EngineConfig

    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(device="cpu", cuda_graphs=True)


def test_graph_sizes():
    from faser.runner.cuda_graphs import graph_sizes

    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_graph_batch"):
        graph_sizes(0)
