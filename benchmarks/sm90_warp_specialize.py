"""What Triton's automatic warp specialisation (``tl.range(..., warp_specialize=True)``) does on
sm_90 with the GPU machine's Triton (3.6), checked on a machine without a GPU.

Each case compiles a small kernel shaped like a part of the dense KL pass
(``msa_megatron/ops/triton/dense_kl.py``: a key tile held, query tiles walked, per-head
``Q K^T`` and exponentials, per-row pointer loads, the ``dk_idx`` product, the ``dq_idx``
additions) for ``GPUTarget("cuda", 90, 32)`` and prints one line:

- ``specialised``: the TTGIR holds ``ttg.warp_specialize``; ``M`` are the row counts of the
  partitions' ``wgmma`` (``BM / 2``: the two consumer warpgroups split the query rows; ``BM``:
  no split, each consumer runs the whole loop, i.e. the work is done twice);
- ``skipped``: compiled without warp specialisation, no diagnostic;
- ``FAILS``: the pass failed, with the first assertion or diagnostic line (printed by the
  compiler on stderr, so each case runs in its own process).

Results and what they mean for the dense KL pass: benchmarks/NOTES.md, "Automatic warp
specialisation on sm_90 (Triton 3.6)". Usage (Triton 3.6 as in sm90_shared_memory.py)::

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/sm90_warp_specialize.py [CASE ...]
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import triton
import triton.language as tl

BM, BN, D = 128, 64, 128
# case: (constexpr switches, num_warps, BM); the default walk holds 2 heads (static_range)
CASES = {
    "plain": ({}, 4, BM),
    "warps8": ({}, 8, BM),
    "bm64": ({}, 4, 64),
    "heads_loop16": ({"HEADS": 16, "STATIC": False}, 4, BM),
    "heads_static16": ({"HEADS": 16}, 4, BM),
    "lse_rows": ({"LSE": True}, 4, BM),
    "row_sum_after": ({"ROW_SUM": True}, 4, BM),
    "dk_product": ({"DK": True}, 4, BM),
    "atomic_add": ({"ATOMIC": True}, 4, BM),
    "tma_add": ({"TMA_ADD": True}, 4, BM),
    "early_return": ({"EARLY_RETURN": True}, 4, BM),
    "else_branch": ({"ELSE": True}, 4, BM),
    "bm64_dk_product": ({"DK": True}, 4, 64),
    "bm64_atomic_add": ({"ATOMIC": True}, 4, 64),
}
_DEFAULTS = {"HEADS": 2, "STATIC": True, "LSE": False, "ROW_SUM": False, "DK": False,
             "ATOMIC": False, "TMA_ADD": False, "EARLY_RETURN": False, "ELSE": False}


@triton.jit
def _head(q_desc, kt, lse_ptr, rows, m, h, BM: tl.constexpr, D: tl.constexpr,
          LSE: tl.constexpr):
    """``exp2(q_h k^T - lse_h)`` of one head (``lse`` by per-row pointer loads when LSE)."""
    s = tl.dot(q_desc.load([m * BM, h * D]), tl.trans(kt))
    if LSE:
        s -= tl.load(lse_ptr + rows * 16 + h)[:, None]
    return tl.exp2(s)


@triton.jit
def _walk_kernel(q_desc, k_desc, qi_desc, dq_desc, lse_ptr, out_ptr, dk_ptr, bad_ptr, m_hi,
                 BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
                 STATIC: tl.constexpr, LSE: tl.constexpr, ROW_SUM: tl.constexpr,
                 DK: tl.constexpr, ATOMIC: tl.constexpr, TMA_ADD: tl.constexpr,
                 EARLY_RETURN: tl.constexpr, ELSE: tl.constexpr):
    """One key tile, the query tiles ``[0, m_hi)`` walked in a warp-specialised loop."""
    if EARLY_RETURN:  # as _isolation.skip
        if tl.load(bad_ptr) != 0:
            return
    n = tl.program_id(0)
    kt = k_desc.load([n * BN, 0])
    kl = tl.zeros([BM], tl.float32)
    dk = tl.zeros([BN, D], tl.float32)
    for m in tl.range(0, m_hi, warp_specialize=True):
        rows = m * BM + tl.arange(0, BM)
        p = tl.zeros([BM, BN], tl.float32)
        if STATIC:
            for h in tl.static_range(HEADS):
                p += _head(q_desc, kt, lse_ptr, rows, m, h, BM, D, LSE)
        else:
            for h in range(HEADS):
                p += _head(q_desc, kt, lse_ptr, rows, m, h, BM, D, LSE)
        if ELSE:
            if tl.load(bad_ptr + m) != 0:
                p = p * 2.0
            else:
                p = p + 1.0
        kl += tl.sum(p, axis=1)
        if DK:  # dk_idx += dz^T q_idx: contracts over the query rows
            dk += tl.dot(tl.trans(p.to(kt.dtype)), qi_desc.load([m * BM, 0]))
        if ATOMIC:  # element atomics (the interpreter's dq_idx path)
            tl.atomic_add(out_ptr + rows, tl.sum(p, axis=1), sem="relaxed")
        if TMA_ADD:  # one bulk tensor reduction per tile (the GPU's dq_idx path)
            dq_desc.atomic_add([m * BM, 0], tl.dot(p.to(kt.dtype), kt))
    if ROW_SUM:  # one KL partial per program: a sum over the query rows after the loop
        tl.store(out_ptr + n, tl.sum(kl, axis=0))
    else:
        tl.store(out_ptr + n * BM + tl.arange(0, BM), kl)
    if DK:
        tl.store(dk_ptr + tl.arange(0, BN)[:, None] * D + tl.arange(0, D)[None, :], dk)


def compile_case(name: str) -> str:
    """Compile case ``name`` for sm_90; its result line (raises on a compile failure)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    switches, warps, bm = CASES[name]
    constants = dict(_DEFAULTS, **switches, BM=bm, BN=BN, D=D)
    signature = {"q_desc": f"tensordesc<bf16[{bm}, {D}]>", "k_desc": f"tensordesc<bf16[{BN}, {D}]>",
                 "qi_desc": f"tensordesc<bf16[{bm}, {D}]>",
                 "dq_desc": f"tensordesc<fp32[{bm}, {D}]>", "lse_ptr": "*fp32",
                 "out_ptr": "*fp32", "dk_ptr": "*fp32", "bad_ptr": "*i32", "m_hi": "i32"}
    signature.update({k: "constexpr" for k in constants})
    with contextlib.redirect_stdout(io.StringIO()):
        kernel = triton.compile(ASTSource(_walk_kernel, signature, constants),
                                target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=2))
    ttgir = kernel.asm["ttgir"]
    where = f"warps {warps} BM {bm}: warps {kernel.metadata.num_warps} shared " \
            f"{kernel.metadata.shared}"
    if "ttg.warp_specialize" not in ttgir:
        return f"skipped      {where}"
    rows = sorted({int(r) for r in re.findall(r"warp_group_dot .*-> tensor<(\d+)x", ttgir)})
    return f"specialised  {where}, wgmma M {rows}"


def run_case(name: str) -> str:
    """``compile_case`` in a fresh process; a failure's first assertion/diagnostic line."""
    env = dict(os.environ, TRITON_ALWAYS_COMPILE="1")
    done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                          text=True, env=env, timeout=600)
    if done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip().splitlines()[-1]
    lines = (done.stderr + done.stdout).splitlines()
    why = next((ln for ln in lines if "Assertion" in ln or "UNREACHABLE" in ln), None)
    why = why or next((ln for ln in lines if "error:" in ln), lines[-1] if lines else "?")
    return f"FAILS        {why.strip()[-240:]}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        print(compile_case(argv[1]))
        return 0
    unknown = [a for a in argv if a not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
        return 2
    print(f"triton {triton.__version__}, sm_90, BN {BN}, D {D}")
    for name in argv or CASES:
        print(f"{name:16s} {run_case(name)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
