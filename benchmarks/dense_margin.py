"""Issue 12's 32K margin on one GPU: dense mode (non-deterministic backward) against cuDNN SDPA
fwd+bwd timed in interleaved pairs, the KL alone at several ``dz`` budgets (key chunks), and
whether each vendor route's LSE marks bad query rows (``dense.lse_guards_q``: the forward then
skips summing ``q``), and the pairs again with the forward's check before the vendor call
(``dense.FORWARD_CHECK``).

One H200 (from the repository root, ~2 minutes)::

    . benchmarks/gpu_env.sh; python benchmarks/dense_margin.py OUT.json

Paper heads (Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, bf16, one sequence of ``--tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_compile import (PAPER, kl_only_fn, loss_and_grads, make_inputs, op_fn,  # noqa: E402
                           paired_ms, sdpa_fn, time_ms)
from provenance import git_commit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--dists", nargs="+", default=["iid", "coherent"])
    parser.add_argument("--budgets-gib", type=float, nargs="*", default=[1, 2, 4, 8],
                        help="dz budgets (GiB) to time the KL alone at; none: skip")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--queued", action="store_true",
                        help="pairs timed as BENCHMARK.md's do_bench loop (no wait between calls)")
    parser.add_argument("--forward-checks", nargs="+", default=["auto", "before"],
                        choices=["auto", "before"], help="dense.FORWARD_CHECK values to pair")
    args = parser.parse_args()
    from msa_megatron.ops import dense
    from msa_megatron.ops.triton import dense_kl_gluon as dkg

    os.environ["MSA_DENSE_DETERMINISTIC"] = "0"
    cfg, dev, dtype = PAPER, torch.device("cuda"), torch.bfloat16
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               commit=git_commit(), tokens=args.tokens, cases={})
    x = make_inputs(cfg, args.tokens, None, "iid", dev, dtype)
    res["lse_guards_q"] = {name: dense.lse_guards_q(route, x["q"], x["k"])
                           for name, route in dense.ROUTES.items()}
    print("lse_guards_q", res["lse_guards_q"], flush=True)
    for dist in args.dists:
        x = make_inputs(cfg, args.tokens, None, dist, dev, dtype)
        fn = op_fn(cfg, "dense")
        whole = lambda: loss_and_grads(fn, x)  # noqa: E731
        for where in args.forward_checks:
            default_check, dense.FORWARD_CHECK = dense.FORWARD_CHECK, where
            try:
                pair = paired_ms(sdpa_fn(x, "CUDNN_ATTENTION", True), whole, args.pairs,
                                 queued=args.queued)
            finally:
                dense.FORWARD_CHECK = default_check
            name = f"dense_vs_cudnn_{dist}" + ("" if where == "auto" else f"_check_{where}")
            res["cases"][name] = pair
            print(f"{dist} (forward check {where}): dense mode {pair['other_ms']:.2f} ms, cuDNN "
                  f"{pair['base_ms']:.2f} ms, ratio {pair['ratio']:.4f} "
                  f"[{pair['ratio_min']:.4f}, {pair['ratio_max']:.4f}], ratio of medians "
                  f"{pair['ratio_of_medians']:.4f}", flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    x = make_inputs(cfg, args.tokens, None, "iid", dev, dtype)
    default = dkg.DZ_BUDGET_BYTES
    for gib in args.budgets_gib:
        dkg.DZ_BUDGET_BYTES = int(gib * (1 << 30))
        try:
            t = time_ms(kl_only_fn(x, cfg), 6)
        finally:
            dkg.DZ_BUDGET_BYTES = default
        res["cases"][f"kl_only_budget_{gib:g}GiB"] = t
        print(f"kl_only dz budget {gib:g} GiB: {t['median']:.2f} ms (min {t['min']:.2f})",
              flush=True)
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
