"""Compiles every kernel variant the wrappers launch for a Hopper GPU (sm_90), with no GPU
present: Triton's compiler and the ptxas it ships run on any Linux x86 machine. Code that the
interpreter forgives but the compiler does not (loop-carried types, constexpr misuse) fails here.

    python tests/kernels/compile_for_hopper.py [--quick]   # a line a variant; exit 1 on failure

Run with TRITON_INTERPRET unset (Triton's own library must be in compile mode). Exit code 3 means
this Triton cannot target NVIDIA here.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

HOPPER = ("cuda", 90, 32)


def _signature(kernel, pointers: dict[str, str], constexprs: dict, scalars: dict) -> dict:
    """Pointers by name (else pointers['default']); other runtime arguments i32 unless named."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointers.get(name, pointers["default"])
        else:
            signature[name] = scalars.get(name, "i32")
    return signature


def _variants(quick: bool):
    """Every dtype and shape family the wrappers launch; `quick`: one of each code path."""
    import triton

    from faser_kernels import triton_attention, triton_cache, triton_rejection

    for dtype in ("bf16",) if quick else ("bf16", "fp16", "fp32"):
        yield (triton_cache._store_kvcache_kernel, {"default": dtype, "slot_mapping_ptr": "i64"},
               {"HEAD_DIM": 128, "BLOCK_D": 128}, {})
    attention_pointers = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32",
                          "cu_seqlens_q_ptr": "i32"}
    attention_shapes = [("bf16", 4, 128, 4), ("fp32", 3, 8, 4)]  # (dtype, group, dim, BLOCK_Q)
    if not quick:
        attention_shapes += [("bf16", 1, 64, 16), ("bf16", 8, 128, 8), ("fp16", 3, 64, 16),
                             ("fp32", 1, 128, 64)]
    for dtype, group, head_dim, block_q in attention_shapes:
        constexprs = {
            "GROUP": group, "GROUP_PAD": triton.next_power_of_2(group), "HEAD_DIM": head_dim,
            "BLOCK_D": max(16, head_dim), "BLOCK_Q": block_q,
            "BLOCK_N": 64 if head_dim <= 64 else 32,
            "PRECISION": "ieee" if dtype == "fp32" else "tf32",
        }
        yield (triton_attention._paged_attention_kernel,
               {"default": dtype, **attention_pointers}, constexprs, {"scale_log2": "fp32"})
    rejection_pointers = {"out_ptr": "i64", "num_accepted_ptr": "i64",
                          "draft_token_ids_ptr": "i64", "cu_num_draft_tokens_ptr": "i64",
                          "is_greedy_ptr": "i1"}
    for dtype in ("fp32",) if quick else ("fp32", "bf16"):
        for has_draft_probs in (True, False):
            yield (triton_rejection._rejection_kernel, {"default": dtype, **rejection_pointers},
                   {"HAS_DRAFT_PROBS": has_draft_probs, "BLOCK_V": 4096}, {})


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile")
        return 2
    try:
        import triton
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:
        print(f"no Triton: {error}")
        return 3
    if "nvidia" not in backends:
        print("this Triton has no NVIDIA backend")
        return 3
    target = GPUTarget(*HOPPER)
    failures = 0
    for kernel, pointers, constexprs, scalars in _variants("--quick" in argv):
        signature = _signature(kernel, pointers, constexprs, scalars)
        label = f"{kernel.__name__} {pointers['default']} {constexprs}"
        start = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target)
        except Exception:  # report every variant, then fail
            failures += 1
            print(f"FAIL {label}\n{traceback.format_exc()}")
            continue
        seconds = time.perf_counter() - start
        print(f"ok   {label}  {seconds:.1f} s  shared={compiled.metadata.shared} B")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
