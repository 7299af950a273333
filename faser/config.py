"""Frozen configuration of the engine core. Pydantic lives at the edges (HTTP, Ray Serve); here,
plain frozen dataclasses with derived values as properties."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("off", "fixed", "dsd", "heuristic", "faser", "faser-nooverlap", "faser-noprune")
MODES = ("overlap", "prune", "off")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How the engine speculates. `policy` names one of POLICIES; `fixed:4` is accepted as a
    shorthand for policy="fixed", num_speculative_tokens=4."""

    policy: str = "off"
    num_speculative_tokens: int = 4  # k of `fixed`; the cap of the adaptive policies
    # batch size -> k, as vLLM / TensorRT-LLM ship it: the first row whose batch size is >= the
    # number of running requests gives k.
    dsd_table: tuple[tuple[int, int], ...] = ((1, 5), (4, 4), (8, 3), (16, 2), (32, 1), (64, 0))
    alpha_prior: float = 0.5  # per-token acceptance before any draft token was verified
    draft_stop_confidence: float = 0.05  # stop drafting a request when its cumulative q falls below
    # greedy requests also guess from earlier occurrences of their newest tokens
    # (faser.spec_decode.lookup), where the target copies
    prompt_lookup: bool = True
    frontier_size: int | None = None  # None: chosen by the policy each step
    profile_cache_dir: str | None = None  # where the cost profile is cached (None: user cache)
    trace_path: str | None = None  # JSON lines, one per step, when set

    def __post_init__(self) -> None:
        policy, k = parse_policy(self.policy, self.num_speculative_tokens)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "num_speculative_tokens", k)
        if not 0.0 < self.alpha_prior < 1.0:
            raise ValueError(f"alpha_prior must lie in (0, 1), got {self.alpha_prior}")

    @property
    def max_k(self) -> int:
        return 0 if self.policy == "off" else self.num_speculative_tokens


def parse_policy(policy: str, default_k: int) -> tuple[str, int]:
    """'fixed:4' -> ('fixed', 4); validates the name."""
    name, _, k_text = policy.partition(":")
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if k_text and not k_text.isdigit():
        raise ValueError(f"policy {policy!r}: the k after ':' must be an integer")
    k = int(k_text) if k_text else default_k
    if not 0 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must lie in [0, 16], got {k}")
    return name, k


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default target
    draft_model: str | None = None  # None: the embedded default draft when model is None
    spec: SpecConfig = field(default_factory=SpecConfig)
    device: str = "cpu"
    dtype: str = "auto"  # "auto": what the device computes natively (faser.runner.precision)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    # reuse the KV of full blocks an earlier request computed for the same leading tokens
    # (faser/runner/block_manager.py); the output is the same either way
    prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    seed: int = 0
    # how linear weights are laid out (faser/runner/weights.py): "packed" (the row-invariant CPU
    # kernel's panels), "dense" (torch's linear), or "auto": "packed" where it runs
    weight_format: str = "auto"
    # the draft's weights (faser/runner/weights.py): "int8" (half the bytes a draft step streams;
    # packed bf16 only), "q8_0" (GGUF's Q8_0 blocks, 0.28x the bytes; packed float32 only),
    # "same" (the target's layout and dtype), or "auto": the one that runs, else "same"
    draft_weights: str = "auto"
    # (target, draft) intra-op threads of the two lanes the overlap mode runs on, on a CPU;
    # None: split the engine's threads (no lanes, so no overlap, with fewer than two)
    lane_threads: tuple[int, int] | None = None
    # torch.compile the models' forwards (dynamic shapes); and, on CUDA, replay CUDA graphs of
    # the forwards whose requests feed one token each (plain decodes, the draft's steps)
    compile: bool = False
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, got device={self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
