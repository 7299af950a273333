"""The engine: one `step()` schedules, chooses k, proposes, verifies and commits."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import torch

from faser.config import EngineConfig, SpecConfig, parse_policy
from faser.engine.model_pair import load_pair
from faser.engine.scheduler import Scheduler, SchedulerOutput
from faser.engine.sequence import Sequence
from faser.engine.stop import append_tokens
from faser.outputs import RequestOutput, SpecStats
from faser.runner.block_manager import BlockManager
from faser.runner.kv_cache import kv_bytes_per_slot
from faser.runner.lanes import make_lanes
from faser.runner.model_runner import ModelRunner
from faser.runner.precision import resolve_dtype
from faser.runner.profiler import (
    DRAFT_POINTS,
    PROFILE_CONTEXT,
    TARGET_POINTS,
    CostProfile,
    checkpoint_fingerprint,
    decode_timer,
    hardware_name,
    load_or_profile,
    profile_key,
)
from faser.sampling_params import SamplingParams
from faser.slo import Slo, request_met
from faser.spec_decode.policy import LoadView, prices_steps
from faser.spec_decode.speculator import Speculator
from faser.spec_decode.state import SpecState
from faser.spec_decode.verifier import Verdict
from faser_kernels import cpu_build, huge_pages

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = replace(config, dtype=resolve_dtype(config.dtype, config.device))
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # denormals in tiny activations take the CPU's slow path: batched generation crawled
        torch.set_flush_denormal(True)
        self.pair = load_pair(config, max_k=16)
        self.tokenizer = self.pair.tokenizer
        self.model_name = self.pair.model_name
        num_blocks = config.num_kv_blocks or self._blocks_for_memory()
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_caching)
        # a request must always fit alone, or preemption could not make room for it
        self.max_model_len = min(self.pair.max_model_len, num_blocks * config.block_size - 17)
        options = self.pair.runner_options
        self.target = ModelRunner(
            self.pair.target, num_blocks, config.block_size, config.device, options
        )
        draft = None
        if self.pair.draft is not None:
            draft = ModelRunner(
                self.pair.draft, num_blocks, config.block_size, config.device, options
            )
            if draft.reads_features:  # target forwards write the features the draft reads
                draft.read_features(self.target.keep_features(self.pair.draft.feature_layers))
        self.scheduler = Scheduler(config, self.blocks,
                                   drafts_from_features=draft is not None and draft.reads_features)
        self.draft = draft
        self.cluster_load = 0.0  # the router's signal (set_cluster_load)
        self.speculator = Speculator(config.spec, self.target, draft, self.pair.token_map,
                                     self.blocks)
        if draft is not None:
            self.speculator.use_lanes(make_lanes(config.device, config.lane_threads))
            if (reason := self._inexact_reason()) is not None:
                logger.warning("speculation is not bit-exact against plain decoding here: %s",
                               reason)
        self._ids = itertools.count()
        self._aborted: list[Sequence] = []

    def _inexact_reason(self) -> str | None:
        """Why the target's step is not row-invariant (so a (k + 1)-token verification may round
        differently from k + 1 decodes and, near a tie, flip a greedy token), or None."""
        if self.pair.weight_format != "packed":
            return f"the {self.pair.weight_format} linear layers are not row-invariant"
        if self.target.attention_backend != "cpu":
            return f"the {self.target.attention_backend} attention is not row-invariant"
        return None

    def _blocks_for_memory(self) -> int:
        dtype = next(self.pair.target.parameters()).dtype
        per_slot = sum(
            kv_bytes_per_slot(len(m.layers), m.num_kv_heads, m.head_dim, dtype)
            for m in (self.pair.target, self.pair.draft) if m is not None
        )
        if getattr(self.pair.draft, "reads_features", False):  # the feature cache's row
            per_slot += self.pair.draft.feature_dim * dtype.itemsize
        slots = int(self.config.kv_cache_memory_gb * 2**30 / per_slot)
        return max(4, slots // self.config.block_size)

    def _profile(self) -> CostProfile:
        """The step-cost profile, measured once per model pair, device (and its model), dtype and
        thread count and cached on disk, on blocks borrowed from the pool so that no live
        request's cache is touched."""
        config, pair = self.config, self.pair
        models = "+".join(checkpoint_fingerprint(d) for d in (pair.target_dir, pair.draft_dir))
        layout = pair.weight_format
        if pair.draft_weights != "same":
            layout = f"{layout}+draft-{pair.draft_weights}"
        if self.target.unfused_reason is None:  # its layers as one call: another cost curve
            layout = f"{layout}+fused"
        if config.device == "cpu":  # the CPU kernels' build prices every step on a CPU
            layout = f"{layout}@{cpu_build.sources_digest()}-{cpu_build.isa()}"
            if pair.weight_format == "packed" and huge_pages.available():
                layout = f"{layout}+huge-pages"
        key = profile_key(models, config.device, config.dtype, config.num_threads, layout,
                          hardware_name(config.device))
        table: list[int] = []
        if not self.blocks.allocate("profile", table, PROFILE_CONTEXT):
            raise RuntimeError("no free KV blocks to profile the step cost on")
        try:
            return load_or_profile(
                key,
                decode_timer(self.target, table),
                decode_timer(self.draft, table),
                [n for n in TARGET_POINTS if n <= config.max_num_batched_tokens],
                [n for n in DRAFT_POINTS if n <= config.max_num_seqs],
                cache_dir=config.spec.profile_cache_dir,
            )
        finally:
            self.blocks.free(table)

    def prepare(self, policies: tuple[str, ...] = ()) -> None:
        """The cost profile the faser policies plan with (the engine's own, or any of
        `policies`), measured here (about a minute on a slow 2-core CPU, then cached) rather than
        inside the first request that needs it."""
        wanted = (self.config.spec.policy, *policies)
        needed = any(name != "off" and prices_steps(name) for name in wanted)
        if self.draft is not None and self.speculator.cost is None and needed:
            self.speculator.use_cost_profile(self._profile())

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        speculation: dict | None = None,
        slo: dict | None = None,
    ) -> str:
        """`speculation`: {"policy": ..., "max_k": ...}, this request's own policy. `slo`:
        {"tpot_ms": ..., "ttft_ms": ...}, the targets SLO-aware speculation keeps to (the faser
        policies) and the request's output reports as met or not."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        prompt_ids = self._tokenize(prompt)
        self._check_request(prompt_ids, params)
        state = self._spec_state(speculation)
        state.slo = Slo.parse(slo)
        state.greedy = params.greedy
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        seq = Sequence(request_id, prompt_ids, params, state, generator)
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.pair.target.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.pair.target.config.vocab_size
        if any(token_id >= vocab for token_id, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must lie in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({len(prompt_ids)} tokens) "
                f"exceeds max_model_len ({self.max_model_len})"
            )

    def _spec_state(self, speculation: dict | None) -> SpecState:
        base = self.config.spec
        policy, max_k = base.policy, base.num_speculative_tokens
        if speculation:
            unknown = set(speculation) - {"policy", "max_k"}
            if unknown:
                raise ValueError(f"speculation: unknown fields {sorted(unknown)}")
            policy, max_k = parse_policy(speculation.get("policy", policy),
                                         speculation.get("max_k", max_k))
        if policy != "off" and not self.speculator.has_draft:
            if speculation and speculation.get("policy", "off") != "off":
                raise ValueError("speculation.policy: this engine has no draft model")
            policy = "off"
        return SpecState(alpha=self.speculator.estimator.prior, policy=policy, max_k=max_k)

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def waiting_request_ids(self) -> list[str]:
        """The requests waiting for a place: a step has not touched their state (a preempted one
        keeps only the tokens that earlier steps committed)."""
        return [seq.request_id for seq in self.scheduler.waiting]

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if self.draft is not None and self.speculator.cost is None:  # a request's own policy
            # may plan with the costs
            self.prepare(tuple({s.spec_state.policy for s in sched.decodes}))
        verdicts, prefill_tokens = self.speculator.run(
            sched.decodes, sched.prefills, self._load(sched)
        )
        return self._commit(sched, verdicts, prefill_tokens)

    def _commit(
        self, sched: SchedulerOutput, verdicts: list[Verdict], prefill_tokens: list[int | None]
    ) -> list[RequestOutput]:
        progressed: list[tuple[Sequence, list[int]]] = []
        for seq, verdict in zip(sched.decodes, verdicts, strict=True):
            progressed.append((seq, self._append(seq, verdict.token_ids)))
        for (seq, _), token in zip(sched.prefills, prefill_tokens, strict=True):
            if token is not None or seq.finish_reason is not None:  # completed, or failed
                progressed.append((seq, self._append(seq, [] if token is None else [token])))
            else:
                self.scheduler.cache_prefix(seq)
        # taken before any output is built: a step that raises on one never repeats an abort
        aborted, self._aborted = self._aborted, []
        outputs = [self._output(seq, new) for seq, new in progressed]
        return outputs + [self._output(seq, []) for seq in aborted]

    def _append(self, seq: Sequence, token_ids: list[int]) -> list[int]:
        new = append_tokens(seq, token_ids, self.pair.eos_token_ids, self.tokenizer)
        del seq.logprobs[len(seq.output_token_ids):]  # those past a stop were never output
        if seq.first_token_time is None and new:  # a request that failed at its prefill has none
            seq.first_token_time = time.perf_counter()
        seq.roll_back_caches()
        self.blocks.truncate(seq.block_table, seq.num_tokens)
        self.scheduler.cache_prefix(seq)
        if seq.finish_reason is not None:
            seq.finish_time = time.perf_counter()
            self.scheduler.finish(seq)
            self._count_slo(seq)
        return new

    def _count_slo(self, seq: Sequence) -> None:
        met = request_met(
            seq.spec_state.slo, seq.arrival_time, seq.first_token_time, seq.finish_time,
            len(seq.output_token_ids),
        )
        if met is None:
            return
        for stats in (seq.stats, self.stats):
            stats.num_slo_requests += 1
            stats.num_slo_met += int(met)

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            spec_stats=replace(seq.stats),
            new_token_ids=new_token_ids,
            metrics=_metrics(seq),
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=(list(seq.prompt_logprobs)
                             if seq.params.prompt_logprobs is not None else None),
            num_cached_tokens=seq.num_cached_prompt_tokens,
        )

    # -- load -------------------------------------------------------------------------------

    def _load(self, sched: SchedulerOutput):
        return LoadView(
            num_running=len(sched.decodes),
            num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=sched.num_prefill_tokens,
            token_budget=sched.token_budget_left,
            cluster_load=self.cluster_load,
        )

    def load_stats(self) -> dict[str, float | int | str]:
        running = self.scheduler.running
        alphas = [s.spec_state.alpha for s in running]
        return {
            "num_running": len(running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_usage": self.blocks.usage,
            "mode": self.speculator.mode,
            "alpha": sum(alphas) / len(alphas) if alphas else self.config.spec.alpha_prior,
        }

    def set_cluster_load(self, load: float) -> None:
        """The router's fleet-wide load signal, which the faser policies read each step."""
        self.cluster_load = max(0.0, float(load))

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def stats(self) -> SpecStats:
        return self.speculator.stats

    @property
    def spec_config(self) -> SpecConfig:
        return self.config.spec


def _metrics(seq: Sequence) -> dict[str, float]:
    metrics = {"arrival_time": seq.arrival_time}
    if seq.first_token_time is not None:
        metrics["first_token_time"] = seq.first_token_time
    if seq.finish_time is not None:
        metrics["finish_time"] = seq.finish_time
    return metrics
