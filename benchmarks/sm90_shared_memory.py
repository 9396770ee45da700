"""Compile every Triton kernel launch of the paper-like shapes for sm_90 on a machine without a GPU
and report its shared memory against the H100/H200 limit (227 KiB).

The interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU but checks no hardware limit: a
kernel can pass every CPU test and still fail on the GPU with ``OutOfResources: shared memory``
(seen 2026-11-30: the sparse KL pass-B kernel at D = Di = 128 asked for 256 KiB). This script
records each launch's signature and constexprs while the backend runs under the interpreter at
real tile sizes (tiny token counts), then compiles each one for ``GPUTarget("cuda", 90, 32)``.
Compile with the Triton version of the GPU machine (3.6 there; shared-memory use differs
between versions, and 3.6's interpreter fails on this CPU's numpy), so record and compile are
two steps::

    python benchmarks/sm90_shared_memory.py record /tmp/launches.pkl        # any Triton
    pip install --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:$PWD python benchmarks/sm90_shared_memory.py compile /tmp/launches.pkl

Inputs: paper heads in bf16 and fp32, the peer heads in bf16, the tp-shard heads in fp16 (tile
sizes depend on the element size, :func:`msa_megatron.ops.triton._common.tile_rows`). ``UPCAST``
is recorded as the GPU sets it (False: only the interpreter upcasts bf16 products), so bf16 is
compiled as it runs on the H200.

Each line also gives ptxas' registers per thread and spill stores / loads in bytes (``ptxas -v``
of the compiled kernel) and how many programs of the kernel fit one multiprocessor (the
occupancy a persistent grid should be sized by). ``compile PATH NAME[,NAME...]`` compiles only
the kernels so named.

Each compiled kernel's SASS (``nvdisasm`` from Triton's wheel) is also checked for uniform
registers read where no path from the kernel's entry has written them (``sass_check.py``).
ptxas 12.8 (Triton 3.6) compiled the v10 backward item kernel so at 128 keys:
the dS^T descriptors of its dQ^T product were built from two never-written uniform registers,
and the H200 read shared memory out of bounds with them (benchmarks/NOTES.md, "v10 backward:
out-of-bounds shared read on the GPU"); its shared-memory size and the TTGIR's buffer offsets
were all within bounds, the interpreter ran it correctly, and ptxas 12.9 (Triton 3.9) compiles the
same PTX correctly, so only this check on the GPU's Triton finds it. Such a line says
``UNINIT`` and names the registers and instruction addresses.

Exit status 1 when a kernel fails to compile, needs more than the limit or reads a uniform
register never written.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import sys

if sys.argv[1:2] == ["record"]:  # kernels run on CPU; compiling needs real JIT functions
    os.environ["TRITON_INTERPRET"] = "1"
else:  # ptxas -v printed by every compile (no cache hit), for registers and spills
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"

import contextlib  # noqa: E402
import io  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from sass_check import sass_text, uninitialized_uniform_reads  # noqa: E402

SHARED_LIMIT = 232448  # bytes per block on sm_90 (227 KiB)
SM_SHARED = 233472  # bytes per multiprocessor on sm_90 (228 KiB)
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
                 torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8", torch.bool: "*i1",
                 torch.uint64: "*u64"}


def record_launches():
    """Run the triton backend on paper-like shapes; return {key: (module, kernel name,
    signature, constexprs, num_warps, num_stages or None)} of every distinct launch."""
    launches = {}
    original = interpreter.GridExecutor.__call__

    def recording(self, *args, **kwargs):
        fn = self.fn
        values = dict(zip(self.arg_names, args))
        values.update({k: v for k, v in kwargs.items()
                       if k not in ("num_warps", "num_stages", "num_ctas")})
        defaults = {k: p.default for k, p in
                    inspect.signature(getattr(fn, "fn", fn)).parameters.items()}
        # Ints the kernel marks do_not_specialize get no divisibility hint on the GPU.
        kernel = getattr(importlib.import_module(fn.__module__), fn.__name__, None)
        plain = set((getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or ())
        signature, constants, aligned = {}, {}, []
        for index, name in enumerate(self.arg_names):
            value = values.get(name, defaults.get(name))
            if name in self.constexprs:
                signature[name], constants[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = POINTER_TYPES[value.dtype]
                aligned.append(index)  # CUDA allocations are 256-byte aligned
            elif isinstance(value, TensorDescriptor):  # bulk-copy tiles (dense KL)
                dtype = POINTER_TYPES[value.base.dtype][1:]
                signature[name] = f"tensordesc<{dtype}{list(value.block_shape)}>"
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                if value % 16 == 0 and name not in plain and index not in plain:
                    aligned.append(index)
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: argument {name} of type {type(value)}")
        if "UPCAST" in constants:  # dot_flags() on the GPU: never upcast
            constants["UPCAST"] = False
        if "TMA_REDUCE" in constants:  # the GPU adds by bulk reductions (interpreter: atomics)
            constants["TMA_REDUCE"] = True
        key = (fn.__module__, fn.__name__, tuple(sorted(map(str, constants.items()))))
        launches[key] = (fn.__module__, fn.__name__, signature, constants,
                         kwargs.get("num_warps", 4), kwargs.get("num_stages"), tuple(aligned))
        return original(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recording
    from msa_megatron.ops.triton import dense_kl

    # the dense KL runs at its GPU tiles (the interpreter's own default is 16 x 16)
    os.environ.setdefault(dense_kl.TILES_ENV, ",".join(map(str, dense_kl.tiles())))
    try:
        from msa_megatron import msa_attention

        # Token counts divisible by 16, as at the GPU's lengths (alignment hints, see above).
        for hq, hkv, hi, dtype, lengths in ((64, 4, 4, torch.bfloat16, [304]),
                                            (64, 4, 4, torch.float32, [304]),
                                            (16, 2, 4, torch.bfloat16, [208, 64]),
                                            (16, 1, 1, torch.float16, [272])):
            T = sum(lengths)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            leaves = [torch.randn(T, h, 128).to(dtype).requires_grad_()
                      for h in (hq, hkv, hkv, hi, 1)]
            for mode in ("sparse", "dense"):
                out, kl = msa_attention(*leaves, cu, block_size=128, top_k=16, mode=mode,
                                        backend="triton")
                torch.autograd.grad((out, kl), leaves, (torch.randn_like(out), torch.ones_like(kl)))
    finally:
        interpreter.GridExecutor.__call__ = original
    return launches


def ptxas_usage(log: str, shared: int, warps: int) -> str:
    """``regs R spill S/L fit/SM N`` from a ``ptxas -v`` log: bytes of spill stores / loads and
    the programs that fit one sm_90 multiprocessor (65536 registers, allocated per warp in units
    of 256; 228 KiB of shared memory, 1 KiB of it reserved per program; 64 warps)."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    fit = "?"
    if regs:
        per_warp = -(-int(regs.group(1)) * 32 // 256) * 256
        fit = min(65536 // (per_warp * warps), SM_SHARED // (shared + 1024), 64 // warps)
    return (f"regs {regs.group(1) if regs else '?'} "
            f"spill {spill.group(1) + '/' + spill.group(2) if spill else '?'} fit/SM {fit}")


def compile_launches(launches, names=None) -> int:
    """Compile each recorded launch for sm_90 (``names``: only these kernels); print shared
    memory, registers and spills; return the count of bad ones."""
    target = GPUTarget("cuda", 90, 32)
    bad = 0
    if names:
        launches = [launch for launch in launches if launch[1] in names]
    print(f"triton {triton.__version__}: {len(launches)} kernel specialisations")
    for module, name, signature, constants, warps, *rest in launches:
        stages = rest[:1]
        # The GPU's JIT marks 16-aligned pointers and integers divisible by 16 (tt.divisibility;
        # not the ints a kernel marks do_not_specialize, recorded so):
        # vectorised, asynchronously copied loads whose pipeline buffers take shared memory
        # (without these hints the KL dense key kernel at 128 rows compiled to 128 KiB; the
        # H200 asked for 256 KiB).
        attrs = {(i,): [["tt.divisibility", 16]] for i in (rest[1] if len(rest) > 1 else ())}
        fn = getattr(importlib.import_module(module), name)
        shown = {k: v for k, v in constants.items() if k in ("HR", "TOK", "ROWS", "D", "DI", "BN",
                                                             "KS", "SPARSE", "FULL", "TOPK",
                                                             "ISO")}
        shown["dtype"] = next((v for k, v in signature.items()
                               if k in ("q_ptr", "qi_ptr", "q_desc")), "")
        try:
            options = dict(num_warps=warps)
            if stages and stages[0] is not None:
                options["num_stages"] = stages[0]
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=target,
                                        options=options)
            shared = kernel.metadata.shared
            over = shared > SHARED_LIMIT
            sass = sass_text(kernel.asm["cubin"])
            uninit = [] if sass is None else uninitialized_uniform_reads(sass)
            bad += over or bool(uninit)
            status = "OVER" if over else "UNINIT" if uninit else "ok  "
            reads = ("sass ?" if sass is None else
                     " ".join(f"{r}@{a:#x}({op})" for a, r, op in uninit[:8]) or "sass ok")
            print(f"{status} {name} {shown} warps {warps} "
                  f"stages {options.get('num_stages', 'default')} shared {shared} "
                  f"{ptxas_usage(log.getvalue(), shared, warps)} {reads}")
        except Exception as error:  # a compile error is a finding, not a crash of the tool
            bad += 1
            print(f"FAIL {name} {shown}: {type(error).__name__}: {str(error)[-300:]}")
    print(f"{bad} kernel(s) over the limit, failing or reading unwritten registers")
    return bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] not in ("record", "compile") or (
            argv[0] == "record" and len(argv) == 3):
        print(__doc__)
        return 2
    if argv[0] == "record":
        launches = sorted(record_launches().values(), key=lambda r: (r[1], str(r[3])))
        with open(argv[1], "wb") as f:
            pickle.dump(launches, f)
        print(f"recorded {len(launches)} kernel specialisations to {argv[1]}")
        return 0
    with open(argv[1], "rb") as f:
        launches = pickle.load(f)
    names = set(argv[2].split(",")) if len(argv) == 3 else None
    return 1 if compile_launches(launches, names) else 0


if __name__ == "__main__":
    sys.exit(main())
