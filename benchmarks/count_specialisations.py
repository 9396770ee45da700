"""Count the Triton kernel specialisations the GPU's JIT would compile for one MSA fwd+bwd, on
CPU (``TRITON_INTERPRET=1``; :class:`bench_cp.CompileWatch`), with the token chunking of a
long sequence forced or the one the length gives::

    TRITON_INTERPRET=1 python benchmarks/count_specialisations.py --chunks 16
    TRITON_INTERPRET=1 python benchmarks/count_specialisations.py          # as the length gives

``--chunks 16``: the per-chunk partial budget is set to one byte, so the forward, backward and
KL run their maximum of 16 token chunks (the paper config runs 16 / 16 / 4 at every length on
the GPU); each chunk passes its own ``sc0, sc1`` ints and ``groups`` / ``n_groups`` slices,
which Triton specialises (an int equal to 1 or divisible by 16, 16-byte pointer alignment).
Prints the new specialisations per kernel for two steps (the second must add none).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_cp  # noqa: E402
from msa_megatron.core import MSAOptions, msa_layer  # noqa: E402
from msa_megatron.ops.triton import _common  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", choices=("16", "auto"), default="auto")
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("run under TRITON_INTERPRET=1 (the count reads the interpreter's launches)")
    watch = bench_cp.CompileWatch()
    if args.chunks == "16":
        _common.PARTIAL_QS, _common.PARTIAL_MIN_BYTES = 0, 1
    x = bench_cp._inputs(args.tokens, bench_cp.SMALL, torch.float16, torch.device("cpu"), 3,
                         False)
    x = {n: t.requires_grad_(True) for n, t in x.items()}
    cu = torch.tensor([0, args.tokens], dtype=torch.int32)
    for step in range(2):
        snap = watch.snapshot()
        res = msa_layer(*(x[n] for n in bench_cp.NAMES), cu_seqlens=cu, kl_scale=1.0 / args.tokens,
                        options=MSAOptions(backend="triton", block_size=16, top_k=4))
        (res.out.float().sum() + res.kl).backward()
        new = watch.since(snap)
        print(f"chunks {args.chunks}, step {step}: {new['compiles']} new specialisations "
              f"{sorted(new['kernels'].items())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
