"""Combine the runs of ``examples/run_retrieval.sh`` into one JSON, a table and a plot.

    python examples/retrieval_report.py runs/retrieval_8192

Reads ``<dir>/<run>/metrics.json`` (written by ``examples/pretrain_tiny.py --task retrieval``)
and writes ``<dir>/retrieval.json`` (every run's held-out retrieval metrics, curves and
arguments), ``<dir>/retrieval.md`` (the comparison table, and "record block chosen" per
layer and index head) and ``<dir>/retrieval.png``
(held-out exact match and selection recall over training, and where the selected blocks lie).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List

ORDER = ("dense", "msa", "random", "local")
LABELS = {"dense": "dense attention", "msa": "MSA, KL-trained index",
          "random": "MSA, frozen random index", "local": "own block only (top-k 1)"}
COLORS = {"msa": "tab:red", "dense": "tab:blue", "random": "tab:green", "local": "tab:gray"}


def load_runs(directory: Path) -> Dict[str, Dict]:
    """``{run name: run record}`` from every ``*/metrics.json`` below ``directory``."""
    runs: Dict[str, Dict] = {}
    for path in sorted(directory.glob("*/metrics.json")):
        record = json.loads(path.read_text())
        for run in record["runs"]:
            run["args"] = record["args"]
            runs[run["name"]] = run
    if not runs:
        raise SystemExit(f"no */metrics.json under {directory}")
    return dict(sorted(runs.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else 9))


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def table(runs: Dict[str, Dict]) -> str:
    """Markdown comparison table (held-out values at the end of training)."""
    lines = ["| run | exact match | answer loss | recall | recall, answer rows | record block "
             "chosen | held-out LM loss | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        r = run.get("retrieval") or {}

        def cell(key: str) -> str:
            value = r.get(key)
            return f"{value:.3f}" if isinstance(value, (int, float)) else "-"

        speed = statistics.median(run["tokens_per_s"][len(run["tokens_per_s"]) // 2:])
        lines.append(f"| {LABELS.get(name, name)} | {cell('exact_match')} | "
                     f"{cell('answer_loss')} | {cell('recall')} | {cell('recall_answer')} | "
                     f"{cell('key_hit')} | {run['held_out_loss']:.3f} | {speed:,.0f} |")
    return "\n".join(lines)


def head_table(runs: Dict[str, Dict]) -> str:
    """Markdown table of "record block chosen" (share of held-out answer rows whose selection
    holds the asked record's block) per layer and index head: one column per (layer, head),
    then the best head of each layer. Empty when no run has the per-head values."""
    found = {name: (run.get("retrieval") or {}).get("key_hit_per_head") for name, run in
             runs.items()}
    found = {name: value for name, value in found.items() if value}
    if not found:
        return ""
    shape = [len(layer) for layer in next(iter(found.values()))]
    columns = [f"L{layer + 1} h{head + 1}" for layer, count in enumerate(shape)
               for head in range(count)]
    best = [f"L{layer + 1} best" for layer in range(len(shape))]
    lines = ["| run | " + " | ".join(columns + best) + " |",
             "|---" * (1 + len(columns) + len(best)) + "|"]
    for name, value in found.items():
        cells = [f"{v:.3f}" for layer in value for v in layer]
        cells += [f"{max(layer):.3f}" if layer else "-" for layer in value]
        cells += ["-"] * (len(columns) + len(best) - len(cells))
        lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: Dict[str, Dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    ax_acc, ax_recall, ax_hist = axes
    warmup = None
    for name, run in runs.items():
        color = COLORS.get(name)
        warmup = int(run["args"]["warmup_steps"])
        if run.get("eval_steps"):
            ax_acc.plot(run["eval_steps"], run["eval_exact_match"], color=color, marker=".",
                        label=LABELS.get(name, name))
        if run.get("probe_steps") and name != "local":
            ax_recall.plot(run["probe_steps"], [_mean(v) for v in run["recall_per_layer"]],
                           color=color, label=f"{name}: recall (uniform rows)")
            ax_recall.plot(run["probe_steps"], [_mean(v) for v in run["key_hit_per_layer"]],
                           color=color, linestyle=":", label=f"{name}: record block chosen")
    for name in ("msa", "random"):
        hist = ((runs.get(name) or {}).get("retrieval") or {}).get("distance_histogram")
        if not hist:
            continue
        labels = list(next(iter(hist.values())).keys())
        totals = [sum(layer[label] for layer in hist.values()) for label in labels]
        share = [t / max(sum(totals), 1) for t in totals]
        offset = -0.2 if name == "msa" else 0.2
        ax_hist.bar([i + offset for i in range(len(labels))], share, width=0.4,
                    color=COLORS[name], label=f"{name} (all layers)")
        ax_hist.set_xticks(range(len(labels)), labels, rotation=45)
    for ax in (ax_acc, ax_recall):
        if warmup is not None:
            ax.axvline(warmup + 0.5, color="black", linewidth=0.8, label="dense -> sparse")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_acc.set_title("held-out exact match of the answers")
    ax_recall.set_title("index selection vs dense teacher")
    ax_hist.set_title("selected blocks by distance from the query's block")
    ax_hist.set_ylabel("share of selected blocks")
    ax_hist.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    runs = load_runs(args.directory)
    summary = {name: {key: run.get(key) for key in (
        "retrieval", "held_out_loss", "eval_steps", "eval_exact_match", "probe_steps",
        "recall_per_layer", "recall_answer_per_layer", "key_hit_per_layer",
        "key_hit_per_head", "seconds",
        "args")} for name, run in runs.items()}
    for name, run in runs.items():  # training answer loss, mean per 10 steps; step time
        losses, steps = run.get("answer_loss") or [], run.get("steps") or []
        summary[name]["answer_loss_steps"] = steps[9::10]
        summary[name]["answer_loss"] = [sum(losses[i:i + 10]) / len(losses[i:i + 10])
                                        for i in range(0, len(losses) - 9, 10)]
        speeds = run.get("tokens_per_s") or []
        summary[name]["median_tokens_per_s"] = statistics.median(speeds) if speeds else None
    (args.directory / "retrieval.json").write_text(json.dumps(summary, indent=1))
    text = table(runs)
    heads = head_table(runs)
    if heads:
        text += ("\n\nRecord block chosen per layer (L) and index head (h), held out:\n\n"
                 + heads)
    (args.directory / "retrieval.md").write_text(text + "\n")
    plot(runs, args.directory / "retrieval.png")
    print(text)
    print(f"wrote {args.directory / 'retrieval.json'}, retrieval.md and retrieval.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
