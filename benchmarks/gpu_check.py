"""GPU check of the CUDA path, with nothing downloaded (random-weight Llama models of real sizes,
written on the spot: a ~1B target and a ~100M draft). Sections, each a table:

  kernels  each Triton kernel against its PyTorch twin on the GPU (parity), and both timed;
  forward  the target's (and draft's) forward time against the tokens in the batch: decodes
           (one token a request) and verifications (5 tokens a request), eager and CUDA graphs;
           graph-against-eager logits parity;
  engine   policies off, fixed:4 and faser at concurrency 1 and 32: with the independent draft
           (random weights: acceptance near 0, so faser should fall back to plain decoding),
           with the target as its own draft (acceptance near 1: the speculation path's upper
           bound), and, unless --quick, the independent draft with CUDA graphs.
  compile  (only with --compile) the target's forward under torch.compile against eager.

Sized to fit a short session on one GPU (--quick: about a third of the work). Results go to
stdout; --out DIR writes DIR/gpu_check.json after every section (partial results survive a
timeout). Exit status 1 when a parity check fails or a section raises.

  python -m benchmarks.gpu_check --out /tmp/gpu            # on a GPU machine
  python -m benchmarks.gpu_check --device cpu --tiny       # the same code on a CPU, tiny models,
                                                           # kernels under Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# as benchmarks.gpu_engine.CONTEXT, which imports torch: Triton's mode must be set first
CONTEXT = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on a CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny models and shapes (CPU smoke run)")
    ap.add_argument("--quick", action="store_true", help="fewer points, shorter generations")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile section")
    ap.add_argument("--sections", default="kernels,forward,engine")
    ap.add_argument("--concurrency", default=None, help="default: 1,32 (1,4 with --tiny)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Triton decides its mode when first imported: the kernels run interpreted on a CPU
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for the CPU smoke run")
        return 3
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    check = Check(args)
    return check.run()


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from benchmarks import gpu_models as models

        self.args, self.device = args, args.device
        self.dtype = args.dtype or ("bfloat16" if self.device != "cpu" else "float32")
        self.tiny = args.tiny
        self.target_spec = models.TINY_TARGET if self.tiny else models.TARGET_1B
        self.draft_spec = models.TINY_DRAFT if self.tiny else models.DRAFT_100M
        default_c = "1,4" if self.tiny else "1,32"
        self.concurrency = [int(c) for c in (args.concurrency or default_c).split(",")]
        self.max_tokens = args.max_tokens or (8 if self.tiny else (48 if args.quick else 128))
        self.prompt_len = args.prompt_len or (8 if self.tiny else 128)
        self.report: dict = {"args": {k: str(v) for k, v in vars(args).items()},
                             "environment": _environment(torch, self.device),
                             "sections": {}, "failures": []}
        self.tmp = Path(tempfile.mkdtemp(prefix="faser-gpu-check-"))
        self.start = time.perf_counter()

    # -- driver ------------------------------------------------------------------------------

    def run(self) -> int:
        env = self.report["environment"]
        print(f"device: {env.get('gpu', self.device)}  torch {env['torch']}  "
              f"triton {env['triton']}  dtype {self.dtype}")
        sections = self.args.sections.split(",") + (["compile"] if self.args.compile else [])
        for name in sections:
            self._section(name, getattr(self, f"section_{name}"))
        total = time.perf_counter() - self.start
        self.report["seconds"] = total
        self._write()
        failures = self.report["failures"]
        print(f"\ntotal {total:.0f} s; " + (f"FAILED: {failures}" if failures else "all checks ok"))
        return 1 if failures else 0

    def _section(self, name: str, fn) -> None:
        start = time.perf_counter()
        print(f"\n=== {name} ===", flush=True)
        try:
            fn()
        except Exception as exc:  # a broken section must not hide the others' figures
            traceback.print_exc()
            self.report["sections"].setdefault(name, {})["error"] = repr(exc)
            self.report["failures"].append(f"{name}: {exc!r}")
        seconds = time.perf_counter() - start
        self.report["sections"].setdefault(name, {})["seconds"] = seconds
        print(f"({name}: {seconds:.1f} s)", flush=True)
        self._write()

    def _write(self) -> None:
        if self.args.out is None:
            return
        self.args.out.mkdir(parents=True, exist_ok=True)
        (self.args.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1))

    def _record(self, section: str, table: str, rows: list[dict]) -> None:
        self.report["sections"].setdefault(section, {})[table] = rows
        for row in rows:
            if row.get("ok") is False:
                self.report["failures"].append(f"{section}/{table}: {row}")

    # -- sections ----------------------------------------------------------------------------

    def section_kernels(self) -> None:
        import torch

        from benchmarks import gpu_kernels as k
        from benchmarks.common import print_table

        shapes, store, rej = self._kernel_shapes()
        dtypes = [torch.float32] + ([] if self.device == "cpu" else [torch.bfloat16])
        parity = k.attention_parity(shapes, dtypes, self.device)
        parity += k.store_parity(store, dtypes, self.device)
        rejection = k.rejection_parity(rej, self.device, seeds=1 if self.tiny else 8)
        self._record("kernels", "attention_store_parity", parity)
        self._record("kernels", "rejection_parity", rejection)
        print_table("Kernel parity, Triton against the PyTorch twin",
                    ["kernel", "case", "dtype", "max abs err / exact", "ok"],
                    [[r["kernel"], r["case"], r["dtype"], r.get("max_abs_err", r.get("exact")),
                      r["ok"]] for r in parity])
        print_table("Rejection sampling parity (requests whose tokens differ)",
                    ["case", "requests", "greedy differ", "sampled differ", "ok"],
                    [[r["case"], r["requests"], r["greedy_differ"], r["sampled_differ"], r["ok"]]
                     for r in rejection])
        dtype = getattr(torch, self.dtype)
        # under the interpreter (a CPU) the times mean nothing: one call shows the code runs
        iters = 1 if self.tiny else 20
        times = k.kernel_times(shapes[:3], store, rej, dtype, self.device, iters,
                               warmup=0 if self.tiny else 2)
        self._record("kernels", "times", times)
        print_table(f"Kernel time per call ({self.dtype}; launches and host syncs included)",
                    ["kernel", "case", "twin us", "triton us", "speedup"],
                    [[r["kernel"], r["case"], r["twin_us"], r["triton_us"], r["speedup"]]
                     for r in times])

    def _kernel_shapes(self):
        from benchmarks.gpu_kernels import AttnShape, RejShape

        if self.tiny:
            heads, kv, dim, ctx, vocab, n = 4, 2, 16, 24, 512, 4
        else:
            heads, kv, dim, ctx, vocab, n = 32, 8, 64, 1024, 32000, 32
        shapes = [
            AttnShape(f"decode {n}x1 @{ctx}", heads, kv, dim, (1,) * n, (ctx,) * n),
            AttnShape(f"verify {n}x5 @{ctx}", heads, kv, dim, (5,) * n, (ctx,) * n),
            AttnShape(f"prefill 1x{2 * ctx}", heads, kv, dim, (2 * ctx,), (0,)),
            AttnShape("mixed, ragged", heads, kv, dim, (1, 5, 3, 17, 1), (ctx, 9, 0, 40, 3)),
            AttnShape("GQA 2, head_dim 128", 8, 4, 128, (1, 4, 9), (30, 0, ctx)),
        ]
        store = [(n, kv, dim), (8 * n if self.tiny else 2048, kv, dim)]
        ks = tuple((i % 5) + 1 for i in range(n))
        rej = [
            RejShape(f"greedy {n} reqs k<=5", ks, (True,) * n, vocab),
            RejShape(f"sampled {n} reqs k<=5", ks, (False,) * n, vocab),
            RejShape(f"mixed {n} reqs, some k=0", tuple(k * (i % 3 > 0) for i, k in
                                                          enumerate(ks)),
                     tuple(i % 2 == 0 for i in range(n)), vocab),
        ]
        return shapes, store, rej

    def _checkpoints(self) -> tuple[Path, Path]:
        from benchmarks.gpu_models import write_checkpoint

        if not hasattr(self, "_dirs"):
            start = time.perf_counter()
            gen_device = self.device if self.device != "cpu" else "cpu"
            target = write_checkpoint(self.target_spec, self.tmp / "target", 0, gen_device)
            draft = write_checkpoint(self.draft_spec, self.tmp / "draft", 1, gen_device)
            self._dirs = (target, draft)
            self.report["models"] = {
                s.name: {"params": s.num_params, **{f: getattr(s, f) for f in s.__slots__}}
                for s in (self.target_spec, self.draft_spec)
            }
            self.report["models"]["write_seconds"] = time.perf_counter() - start
            print(f"random checkpoints: {self.target_spec.name} "
                  f"({self.target_spec.num_params / 1e6:.0f}M), {self.draft_spec.name} "
                  f"({self.draft_spec.num_params / 1e6:.0f}M) in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        return self._dirs

    def _llm(self, draft: Path, **options):
        from benchmarks.gpu_engine import build_llm

        target, _ = self._checkpoints()
        start = time.perf_counter()
        # room for the forward section's timed requests too
        max_len = max(self.prompt_len + self.max_tokens + 16, CONTEXT + 64)
        llm = build_llm(target, draft, self.device, self.dtype, max(self.concurrency), max_len,
                        self.tmp / "profiles", **options)
        print(f"engine loaded in {time.perf_counter() - start:.1f} s {options or ''}", flush=True)
        return llm

    def section_forward(self) -> None:
        from benchmarks.common import print_table
        from benchmarks.gpu_engine import forward_curve, graph_parity, make_runner
        from faser.runner.model_runner import RunnerOptions

        _, draft_dir = self._checkpoints()
        llm = self._llm(draft_dir)
        target, draft = llm.engine.pair.target, llm.engine.pair.draft
        cuda = self.device.startswith("cuda")
        if self.tiny:
            points = [1, 4, 8]
        elif self.args.quick:
            points = [1, 4, 16, 32, 64, 128, 256]
        else:
            points = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512]
        max_graph = 256 if not self.tiny else 16
        graph_options = RunnerOptions(cuda_graphs=True, max_graph_batch=max_graph,
                                      max_blocks_per_seq=32)
        runners = {
            "target decode ms": (make_runner(target, self.device), "decode"),
            "target verify ms": (make_runner(target, self.device), "verify"),
            "draft decode ms": (make_runner(draft, self.device), "decode"),
        }
        if cuda:
            start = time.perf_counter()
            runners["target graphs ms"] = (make_runner(target, self.device, graph_options),
                                           "decode")
            runners["draft graphs ms"] = (make_runner(draft, self.device, graph_options),
                                          "decode")
            capture = time.perf_counter() - start
            self.report["sections"].setdefault("forward", {})["capture_seconds"] = capture
        rows = forward_curve(runners, points, self.device, reps=1 if self.tiny else 7)
        self._record("forward", "curve", rows)
        header = ["tokens", *runners]
        print_table(f"Forward time against tokens in the batch ({self.dtype}, {CONTEXT_NOTE})",
                    header, [[r[h] if r[h] is not None else "-" for h in header] for r in rows])
        del runners
        if cuda:
            sizes = [1, 3, 32] if not self.tiny else [1, 3]
            parity = graph_parity(target, self.device, sizes, max_batch=32)
            self._record("forward", "graph_parity", parity)
            print_table("CUDA graph replay against eager, target logits of one decode step",
                        ["batch", "max abs err", "max |logit|", "argmax agree", "ok"],
                        [[r["batch"], r["max_abs_err"], r["max_logit"], r["argmax_agree"],
                          r["ok"]] for r in parity])
        del llm
        _free()

    def section_engine(self) -> None:
        from benchmarks.common import print_table
        from benchmarks.gpu_engine import engine_runs
        from benchmarks.gpu_models import random_prompts

        target_dir, draft_dir = self._checkpoints()
        prompts = random_prompts(max(self.concurrency), self.prompt_len,
                                 self.target_spec.vocab, seed=0)
        policies = ["off", "fixed:4", "faser"]
        variants = [("independent draft", draft_dir, {}),
                    # the upper bound, every draft accepted: no prompt lookup, whose guesses
                    # could only replace tokens that are always right
                    ("draft = target", target_dir, {"prompt_lookup": False})]
        if self.device.startswith("cuda") and not self.args.quick:
            variants.append(("independent draft, CUDA graphs", draft_dir, {"cuda_graphs": True}))
        rows: list[dict] = []
        for label, draft, options in variants:
            llm = self._llm(draft, **options)
            rows += engine_runs(llm, label, prompts, self.concurrency, policies,
                                self.max_tokens)
            self._record("engine", "policies", rows)
            self._write()
            del llm
            _free()
        print_table(
            f"Engine, greedy, {self.prompt_len}-token prompts, {self.max_tokens} new tokens "
            f"each, all requests at once ({self.dtype})",
            ["models", "conc", "policy", "tok/s", "ms/token", "accept", "mean len", "same as off",
             "mode"],
            [[r["models"], r["concurrency"], r["policy"], r["tokens_per_s"], r["ms_per_token"],
              _opt(r["acceptance_rate"]), r["mean_acceptance_length"], _opt(r["same_as_off"]),
              _opt(r["mode"])] for r in rows],
        )

    def section_compile(self) -> None:
        from benchmarks.common import print_table
        from benchmarks.gpu_engine import decode_chunks, forward_curve, make_runner
        from faser.runner.model_runner import RunnerOptions

        _, draft_dir = self._checkpoints()
        llm = self._llm(draft_dir)
        target = llm.engine.pair.target
        eager = make_runner(target, self.device)
        compiled = make_runner(target, self.device, RunnerOptions(compile=True))
        start = time.perf_counter()
        points = [1, 8, 32, 128] if not self.tiny else [1, 4]
        first = compiled.forward(decode_chunks(8))
        compile_s = time.perf_counter() - start
        want = eager.forward(decode_chunks(8))
        err = float((first - want).abs().max())
        rows = forward_curve({"eager ms": (eager, "decode"), "compiled ms": (compiled, "decode")},
                             points, self.device, reps=5)
        self._record("compile", "curve", rows)
        self._record("compile", "parity", [{"max_abs_err": err, "first_call_s": compile_s,
                                            "ok": err <= 2e-2 * max(1.0, float(want.abs().max()))}])
        print_table(f"torch.compile (first call {compile_s:.0f} s, max abs err {err:.3g})",
                    ["tokens", "eager ms", "compiled ms"],
                    [[r["tokens"], r["eager ms"], r["compiled ms"]] for r in rows])
        del llm
        _free()


CONTEXT_NOTE = f"each request attends to {CONTEXT} cached tokens"


def _opt(value):
    return "-" if value is None else value


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _environment(torch, device: str) -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__,
           "python": sys.version.split()[0], "kernels": os.environ.get("FASER_KERNELS", "auto")}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   sms=props.multi_processor_count, memory_gb=props.total_memory / 2**30,
                   green_contexts=hasattr(torch.cuda, "green_contexts"))
    return env


if __name__ == "__main__":
    sys.exit(main())
