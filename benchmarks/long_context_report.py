"""Issue 16 item 4: the table and plot of long-context runs of the tiny example, MSA against
dense attention from the same dense warm-up (``benchmarks/gpu_long_context.sh``).

Reads the ``metrics.json`` files that ``examples/pretrain_tiny.py`` writes (one file may hold
both variants, or one variant each when they ran as two processes with the same seed and
data) and writes:

- ``<out>.json``: per row the layout, sequence length, steps, and per variant the held-out
  loss, tokens/s after the switch (tokens over seconds of the steps after the warm-up but the
  first, whose Triton compiles take up to ~30 s: the rate of the whole stretch, not a mean of
  per-step rates), the selection recall at the first probe after the switch and the mean of
  the last 4 probes, the loss difference (MSA - dense) of the training loss averaged over the
  last 50 steps, and MSA's tokens/s over dense's;
- ``<out>.md``: the same as a Markdown table;
- ``<out>.png``: per row, the training-loss difference MSA - dense (smoothed over 10 steps) and
  the recall of both variants against the step.

Usage::

    python benchmarks/long_context_report.py OUT \\
        --row "64K, CP 1, 1x H100=results/long_context/h100x1_2026-12-07/cp1_65536_metrics.json" \\
        --row "128K, CP 1, 1x H100=a_msa.json,a_dense.json"
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Sequence

LAST_PROBES = 4     # recall: mean of this many last probes (one probe moves by 0.02-0.1)
LAST_STEPS = 50     # training-loss difference: mean over this many last common steps


def load_variants(paths: Sequence[str]) -> Dict[str, dict]:
    """``{variant name: run record}`` from one or more ``metrics.json`` files, with each
    record's ``args`` attached. The files of one row must agree on the sequence length, the
    warm-up and the layout (else ``ValueError`` naming the files)."""
    runs: Dict[str, dict] = {}
    first_args = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        args = data["args"]
        key = (args["seq_len"], args["warmup_steps"], args["tp"], args["cp"], args["top_k"])
        if first_args is None:
            first_args = (key, path)
        elif key != first_args[0]:
            raise ValueError(f"{path} ran (seq_len, warmup_steps, tp, cp, top_k) = {key}, "
                             f"{first_args[1]} ran {first_args[0]}: not one comparison")
        for run in data["runs"]:
            if run["name"] in runs:
                raise ValueError(f"variant {run['name']!r} appears twice (again in {path})")
            runs[run["name"]] = dict(run, args=args)
    return runs


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summarise(run: dict) -> dict:
    """One variant's numbers (see the module docstring)."""
    args = run["args"]
    warm = args["warmup_steps"]
    seq = args["seq_len"]
    after = [i for i, s in enumerate(run["steps"]) if s > warm + 1]  # first: compiles
    seconds = sum(seq / run["tokens_per_s"][i] for i in after)
    probes = [i for i, s in enumerate(run["probe_steps"]) if s > warm]
    recall = [_mean(run["recall_per_layer"][i]) for i in probes]
    return {
        "steps": run["steps"][-1] if run["steps"] else 0,
        "held_out_loss": run["held_out_loss"],
        "tokens_per_s": len(after) * seq / seconds if seconds > 0 else math.nan,
        "recall_first_after_switch": recall[0] if recall else math.nan,
        "recall_last_probes": _mean(recall[-LAST_PROBES:]),
        "attended_fraction": _mean([run["attended_fraction"][i] for i in after]),
    }


def loss_gaps(msa: dict, dense: dict) -> List[tuple]:
    """``[(step, training loss MSA - dense)]`` over the steps both logged (the same windows in
    the same order when both ran with one seed)."""
    d = dict(zip(dense["steps"], dense["loss"]))
    return [(s, l - d[s]) for s, l in zip(msa["steps"], msa["loss"]) if s in d]


def loss_gap(msa: dict, dense: dict) -> float:
    """Mean of :func:`loss_gaps` over the last :data:`LAST_STEPS` common steps."""
    return _mean([g for _, g in loss_gaps(msa, dense)[-LAST_STEPS:]])


def row_record(label: str, paths: Sequence[str]) -> dict:
    runs = load_variants(paths)
    missing = {"msa", "dense"} - set(runs)
    if missing:
        raise ValueError(f"row {label!r}: no {sorted(missing)} variant in {list(paths)}")
    args = runs["msa"]["args"]
    msa, dense = summarise(runs["msa"]), summarise(runs["dense"])
    return {
        "label": label, "files": list(paths), "seq_len": args["seq_len"], "tp": args["tp"],
        "cp": args["cp"], "warmup_steps": args["warmup_steps"], "top_k": args["top_k"],
        "block_size": args["block_size"],
        "msa": msa, "dense": dense,
        "train_loss_gap_last_steps": loss_gap(runs["msa"], runs["dense"]),
        "speedup_tokens_per_s": msa["tokens_per_s"] / dense["tokens_per_s"],
        "_runs": runs,
    }


def table(rows: List[dict]) -> str:
    head = ("| run | steps (dense warm-up) | held-out loss MSA / dense | training loss MSA - dense, "
            f"last {LAST_STEPS} steps | tokens/s MSA / dense (x) | recall after the switch -> "
            f"mean of last {LAST_PROBES} probes | blocks attended |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        m, d = r["msa"], r["dense"]
        lines.append(
            f"| {r['label']} | {m['steps']} ({r['warmup_steps']}) | {m['held_out_loss']:.4f} / "
            f"{d['held_out_loss']:.4f} | {r['train_loss_gap_last_steps']:+.3f} | "
            f"{m['tokens_per_s'] / 1e3:,.0f}K / {d['tokens_per_s'] / 1e3:,.0f}K "
            f"({r['speedup_tokens_per_s']:.2f}x) | {m['recall_first_after_switch']:.3f} -> "
            f"{m['recall_last_probes']:.3f} | {m['attended_fraction']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for r in rows:
        pairs = loss_gaps(r["_runs"]["msa"], r["_runs"]["dense"])
        steps = [s for s, _ in pairs]
        gaps = [g for _, g in pairs]
        smooth = [_mean(gaps[max(0, i - 9):i + 1]) for i in range(len(gaps))]
        line, = axes[0].plot(steps, smooth, label=r["label"])
        for ax in axes:
            ax.axvline(r["warmup_steps"], color=line.get_color(), linewidth=0.6, alpha=0.5)
        for name, style in (("msa", "-"), ("dense", ":")):
            run = r["_runs"][name]
            axes[1].plot(run["probe_steps"], [_mean(x) for x in run["recall_per_layer"]],
                         style, label=f"{r['label']}: {name}")
    axes[0].axhline(0.0, color="black", linewidth=0.8)
    axes[0].set(title="training loss, MSA - dense (10-step mean; thin line: the switch)",
                xlabel="step", ylabel="nats / byte")
    axes[1].set(title="selection recall of the dense attention mass", xlabel="step",
                ylabel="share", ylim=(0, 1.02))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="output prefix: writes OUT.json, OUT.md and OUT.png")
    parser.add_argument("--row", action="append", required=True, metavar="LABEL=FILE[,FILE]",
                        help="one comparison: its label and the metrics.json file(s) holding "
                             "its msa and dense variants")
    parser.add_argument("--note", default="", help="free text stored in OUT.json")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.row:
        label, sep, files = spec.partition("=")
        if not sep or not files:
            parser.error(f"--row {spec!r}: expected LABEL=FILE[,FILE]")
        rows.append(row_record(label, files.split(",")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"note": args.note,
              "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(table(rows))
    plot(rows, out.with_suffix(".png"))
    print(table(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
