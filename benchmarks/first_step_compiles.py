"""GPU: Triton compiles of the first MSA fwd+bwd steps at the paper config, and a bitwise
fingerprint of the results to compare against another revision of the kernels::

    python benchmarks/first_step_compiles.py --tree /tmp/v9 --lengths 65536 --out /tmp/v9.json
    python benchmarks/first_step_compiles.py --lengths 65536,65613 --compare /tmp/v9.json

Each step is one sparse ``msa_layer`` fwd+bwd (Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, B 128,
k 16, bf16, seeded inputs), in this order; per step it prints the kernels compiled
(``compile_watch.CompileWatch``: Triton's JIT hooks, an empty ``TRITON_CACHE_DIR`` so every
variant really compiles; under ``TRITON_INTERPRET=1`` the JIT keys a GPU would compile) and
their seconds. The first step's outputs (selection, output, KL, the five input gradients) are
hashed (SHA-256 of the bytes); ``--out`` writes them, ``--compare`` checks them against a file
written by another revision (``--tree``: import ``msa_megatron`` from that directory) and exits
1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="65536", help="tokens per step, comma-separated")
    parser.add_argument("--tree", default=None, help="import msa_megatron from this directory")
    parser.add_argument("--out", default=None, help="write the first step's hashes here")
    parser.add_argument("--compare", default=None, help="hashes written by another revision")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a smoke test under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else
                    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    import msa_megatron
    from msa_megatron.core import MSAOptions, msa_layer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compile_watch import CompileWatch

    watch = CompileWatch()  # Triton's JIT hooks (under the interpreter: the keys it would build)
    print(f"msa_megatron from {os.path.dirname(msa_megatron.__file__)}, "
          f"TRITON_CACHE_DIR {os.environ['TRITON_CACHE_DIR']}", flush=True)
    dev = torch.device(args.device)
    hashes = {}
    for step, total in enumerate(int(x) for x in args.lengths.split(",")):
        gen = torch.Generator(device=dev).manual_seed(1234 + total)
        leaves = [torch.randn((total, h, 128), generator=gen, device=dev,
                              dtype=torch.bfloat16).requires_grad_(True)
                  for h in (64, 4, 4, 4, 1)]
        cu = torch.tensor([0, total], dtype=torch.int32, device=dev)
        snap, t0 = watch.snapshot(), time.perf_counter()
        res = msa_layer(*leaves, cu_seqlens=cu, kl_scale=1.0 / total,
                        options=MSAOptions(backend="triton", block_size=128, top_k=16))
        dout = torch.randn(res.out.shape, generator=gen, device=dev, dtype=res.out.dtype)
        grads = torch.autograd.grad((res.out, res.kl), leaves, (dout, torch.ones_like(res.kl)))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        new = watch.since(snap)
        print(f"step {step + 1}: {total} tokens, {new['compiles']} kernels compiled in "
              f"{new['compile_s']:.1f} s (step {time.perf_counter() - t0:.1f} s) "
              f"{sorted(new['kernels'].items())}", flush=True)
        if step == 0:
            named = {"block_idx": res.block_idx, "out": res.out, "kl": res.kl,
                     **{f"d{n}": g for n, g in zip(("q", "k", "v", "q_idx", "k_idx"), grads)}}
            for name, t in named.items():
                raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                hashes[name] = hashlib.sha256(raw.tobytes()).hexdigest()
        del res, grads, leaves, dout
    count, seconds, _ = watch.snapshot()
    print(f"total: {count} kernels compiled in {seconds:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            ref = json.load(f)
        bad = [name for name in ref if ref[name] != hashes.get(name)]
        print(f"bitwise vs {args.compare}: {'identical' if not bad else 'DIFFERENT: ' + str(bad)}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
