"""One whole MSA step at a very long sequence (default 1M tokens, paper config): finite, and
correct on sampled rows against the float64 oracle (issue 11: "a 1M-token paper-config step
finite and correct on sampled rows").

The oracle cannot run over 1M x 1M scores, but every per-row quantity can be checked row by
row: for each sampled query row ``p`` of the single sequence the oracle computes, in float64
from the same bf16 inputs, (1) the block selection of ``p`` (``select_core_reference`` with the
row's layout ``q_pos = p, q_kbase = 0`` over all keys), compared with the kernels' selection
(a differing set passes only as a near-tie, ``bench_kernels.near_tie``); (2) the output row
and ``dq[p]`` (``dq`` of a row depends only on that row's forward and ``dout[p]``) given the
kernels' selection; (3) ``dq_idx[p]`` (the KL of row ``p`` is the only term that depends on
``q_idx[p]``). ``dk``, ``dv``, ``dk_idx`` and the KL value depend on every row: they are checked
for finiteness only. Errors are ``|a - b| / |b|`` over the sampled rows (Frobenius norms), the
measure of ``bench_kernels.rel``; the spec's bf16 bar is 1e-2 (observed ~2-3e-3 at 4K).

Usage (one H200, ~2-3 min at 1M; JSON written at the end)::

    . benchmarks/gpu_env.sh && python benchmarks/long_check.py $OUT/long_check_1m.json \\
        [--commit SHA]   # the code's commit, where the copy run carries stale git metadata
    TRITON_INTERPRET=1 python benchmarks/long_check.py /tmp/l.json --tokens 300 --rows 6 \\
        --dtype float16 --heads 4,2,2,1 --head-dim 16 --block 16 --top-k 3   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import msa_megatron
from msa_megatron import reference as ref

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import near_tie, rel  # noqa: E402
from provenance import git_commit  # noqa: E402

BAR = 1e-2  # the spec's relative error bar for bf16 / fp16 outputs and gradients


def parse_heads(text: str):
    """``"Hq,Hkv,Hi,Hik"`` -> four ints (ValueError naming the flag otherwise)."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--heads must be four positive integers Hq,Hkv,Hi,Hik, got {text!r}")
    return [int(p) for p in parts]


def sample_rows(t: int, n: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """``min(n, t)`` distinct rows, ascending: the first and the last row, then both sides of
    the first block boundary (as many of these as ``n`` allows, in that order), the rest at
    random."""
    chosen = list(dict.fromkeys(r for r in (0, t - 1, block - 1, block) if 0 <= r < t))[:n]
    while len(chosen) < min(n, t):
        r = int(torch.randint(0, t, (1,), generator=gen))
        if r not in chosen:
            chosen.append(r)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON result path")
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--rows", type=int, default=32, help="sampled query rows")
    parser.add_argument("--heads", default="64,4,4,1", help="Hq,Hkv,Hi,Hik (paper: 64,4,4,1)")
    parser.add_argument("--head-dim", type=int, default=128, help="D = Di")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None,
                        help="commit recorded in the JSON (default: provenance.git_commit())")
    args = parser.parse_args()
    try:
        hq, hkv, hi, hik = parse_heads(args.heads)
    except ValueError as error:
        parser.error(str(error))
    if args.tokens < 1 or args.rows < 1:
        parser.error(f"--tokens ({args.tokens}) and --rows ({args.rows}) must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    t, d = args.tokens, args.head_dim
    opts = dict(block_size=args.block, top_k=args.top_k, backend="triton")
    try:  # every shape and option checked on meta tensors, before any memory or kernel
        meta = [torch.empty(t, h, d, dtype=dtype, device="meta") for h in (hq, hkv, hkv, hi, hik)]
        msa_megatron.msa_attention(*meta, **opts)
    except (TypeError, ValueError) as error:
        parser.error(f"--heads {args.heads} --head-dim {d} --block {args.block} --top-k "
                     f"{args.top_k} --tokens {t}: {error}")
    try:  # the output path, before minutes of GPU work
        with open(args.out, "w") as fh:
            json.dump({"status": "running", "argv": sys.argv[1:]}, fh)
    except OSError as error:
        parser.error(f"cannot write the result to {args.out}: {error}")
    gen = torch.Generator(device="cpu").manual_seed(args.seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device, dtype)

    x = dict(q=rand(t, hq, d), k=rand(t, hkv, d), v=rand(t, hkv, d), q_idx=rand(t, hi, d),
             k_idx=rand(t, hik, d))
    dout = rand(t, hq, d)
    for v in x.values():
        v.requires_grad_(True)
    result = dict(tokens=t, heads=dict(hq=hq, hkv=hkv, hi=hi, hik=hik), head_dim=d,
                  block=args.block, top_k=args.top_k, dtype=args.dtype,
                  gpu=(torch.cuda.get_device_name() if device.type == "cuda"
                       else f"none (CPU {platform.machine()}, Triton interpreter)"),
                  torch=torch.__version__, commit=args.commit or git_commit(),
                  started=time.strftime("%F %T"))

    def step():
        for v in x.values():
            v.grad = None
        out, kl = msa_megatron.msa_attention(x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], **opts)
        torch.autograd.backward([out, kl], [dout, torch.ones_like(kl)])
        return out.detach(), kl.detach()

    t0 = time.time()
    step()  # compiles
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result["first_step_s"] = time.time() - t0
    t0 = time.time()
    out, kl = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        result["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    result["step_s"] = time.time() - t0
    grads = {f"d{n}": v.grad for n, v in x.items()}
    result["finite"] = {"out": bool(torch.isfinite(out).all()), "kl": bool(torch.isfinite(kl)),
                        **{n: bool(torch.isfinite(g).all()) for n, g in grads.items()}}
    result["kl"] = float(kl)
    with torch.no_grad():
        sel = msa_megatron.select_blocks(x["q_idx"].detach(), x["k_idx"].detach(), **opts)

    rows = sample_rows(t, args.rows, args.block, gen).to(device)
    result["sampled_rows"] = rows.tolist()
    result["rows"] = int(rows.numel())
    k_idx64 = x["k_idx"].detach().double()  # every row's selection reads all index keys
    got = {"out": [], "dq": [], "dq_idx": []}
    want = {"out": [], "dq": [], "dq_idx": []}
    differing, not_near_tie = 0, 0
    kl_scale = 1.0 / (t * hi)
    for p in rows.tolist():
        pos = torch.tensor([p], dtype=torch.int32, device=device)
        base = torch.zeros(1, dtype=torch.int32, device=device)
        qi = x["q_idx"].detach()[p:p + 1].double()
        want_sel = ref.select_core_reference(qi, k_idx64, pos, base, block_size=args.block,
                                             top_k=args.top_k)
        got_sel = sel[p:p + 1]
        if not torch.equal(want_sel, got_sel):
            s = ref.block_scores_reference(qi, k_idx64, pos, base, block_size=args.block)
            for i in range(hi):
                if not torch.equal(got_sel[0, i], want_sel[0, i]):
                    differing += 1
                    not_near_tie += not near_tie(got_sel[0, i], want_sel[0, i], s[i, 0],
                                                 p // args.block)
        # The oracle over the row's selected blocks only, laid out as one compact sequence:
        # selected blocks ascending end with the own block (the only partial one), so the
        # compact layout has the same support as the full one at a fraction of its size (the
        # full layout repeats K to every query head: 64 GiB in float64 at 1M tokens).
        blocks = got_sel[0][got_sel[0] >= 0].unique()  # union over the index heads, ascending
        keys = (blocks[:, None] * args.block + torch.arange(args.block, device=device)).flatten()
        keys = keys[keys <= p]
        remap = torch.full((int(blocks.max()) + 1,), -1, dtype=torch.int32, device=device)
        remap[blocks.long()] = torch.arange(blocks.numel(), dtype=torch.int32, device=device)
        sel_c = torch.where(got_sel >= 0, remap[got_sel.clamp_min(0).long()], got_sel)
        pos_c = torch.tensor([(blocks.numel() - 1) * args.block + p % args.block],
                             dtype=torch.int32, device=device)
        q_row = x["q"].detach()[p:p + 1].double().requires_grad_(True)
        k_rows, v_rows = (x[n].detach()[keys].double() for n in ("k", "v"))
        o, _ = ref.attention_core_reference(q_row, k_rows, v_rows, sel_c, pos_c,
                                            base, block_size=args.block)
        (o * dout[p:p + 1].double()).sum().backward()
        qi_row = qi.clone().requires_grad_(True)
        kl_row = ref.kl_core_reference(q_row.detach(), k_rows, qi_row,
                                       k_idx64[keys], sel_c, pos_c, base,
                                       block_size=args.block, kl_scale=kl_scale)
        kl_row.backward()
        want["out"].append(o.detach())
        want["dq"].append(q_row.grad)
        want["dq_idx"].append(qi_row.grad)
        got["out"].append(out[p:p + 1])
        got["dq"].append(grads["dq"][p:p + 1])
        got["dq_idx"].append(grads["dq_idx"][p:p + 1])
    result["select"] = dict(row_heads_differing=differing, not_near_tie=not_near_tie,
                            row_heads=int(rows.numel()) * hi)
    result["errors"] = {n: rel(torch.cat(got[n]), torch.cat(want[n])) for n in got}
    result["ok"] = (all(result["finite"].values()) and not_near_tie == 0
                    and all(e <= BAR for e in result["errors"].values()))
    print(json.dumps(result))
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
