"""Combine the runs of ``examples/run_retrieval.sh`` into one JSON, a table and a plot.

    python examples/retrieval_report.py runs/retrieval_8192
    python examples/retrieval_report.py --from-json retrieval_r32768.json [--out-dir DIR]

Reads ``<dir>/<run>/metrics.json`` (written by ``examples/pretrain_tiny.py --task retrieval``;
also the stored ``<dir>/metrics_<run>.json.gz`` of ``benchmarks/results/``, and
``<dir>/metrics.json`` itself: the ``--out-dir`` of one ``pretrain_tiny.py`` run) and writes
``<dir>/retrieval.json`` (every run's held-out retrieval metrics, curves and arguments),
``<dir>/retrieval.md`` (the comparison table, and "record block chosen" per
layer and index head) and ``<dir>/retrieval.png``
(held-out exact match and selection recall over training, and where the selected blocks lie).

``--from-json``: the table and the plot again from a ``retrieval.json`` this script wrote (e.g.
one committed under ``benchmarks/results/``), without the runs' metrics: ``<stem>.md`` and
``<stem>.png`` beside it (or in ``--out-dir``); the JSON itself is left as it is.

Runs of ``--task text`` (no questions) have no held-out retrieval metrics: their recall and best
recall are those of the last selection probe of training (on a training window; the table's
note says at which step), a column "recall, mean of last 4 probes" averages the last 4 probes
after the dense warm-up (a probe alone moves by 0.02-0.1), and the retrieval-only columns read
"-".
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ORDER = ("dense", "msa", "random", "local")
LABELS = {"dense": "dense attention", "msa": "MSA, KL-trained index",
          "random": "MSA, frozen random index", "local": "own block only (top-k 1)"}
COLORS = {"msa": "tab:red", "dense": "tab:blue", "random": "tab:green", "local": "tab:gray"}
WARMUP_COLOR = "black"  # the warm-up every variant starts from


PATTERNS = ("*/metrics.json", "*/metrics.json.gz", "metrics_*.json", "metrics_*.json.gz",
            "metrics.json", "metrics.json.gz")  # the last two: one pretrain_tiny.py --out-dir


def _read(path: Path) -> Dict:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt") as handle:
            return json.load(handle)
    return json.loads(path.read_text())


def load_runs(directory: Path, notes: Optional[List[str]] = None) -> Dict[str, Dict]:
    """``{run name: run record}`` from the metrics files below ``directory``: every
    ``*/metrics.json`` (``examples/run_retrieval.sh``, ``benchmarks/gpu_retrieval*.sh``),
    the stored form ``metrics_<run>.json.gz`` of ``benchmarks/results/`` and ``metrics.json``
    in ``directory`` itself (the ``--out-dir`` of one ``examples/pretrain_tiny.py`` run).
    Appends to ``notes`` (when given) what is missing: a run whose log or directory is there (or
    that a record's ``--runs`` lists) without metrics, an unreadable file, a run found twice (the
    first one is kept).

    Raises SystemExit with the places looked at when no run is found."""
    if not directory.is_dir():
        raise SystemExit(f"{directory} is not a directory (give the OUT of run_retrieval.sh, "
                         "the runs/<name> of gpu_retrieval_chain.sh, a benchmarks/results "
                         "directory or the --out-dir of one pretrain_tiny.py run)")
    runs: Dict[str, Dict] = {}
    notes = [] if notes is None else notes
    expected: List[str] = []
    for pattern in PATTERNS:
        for path in sorted(directory.glob(pattern)):
            try:
                record = _read(path)
                found = record["runs"]
            except (OSError, ValueError, KeyError, TypeError, EOFError) as error:
                notes.append(f"{path.relative_to(directory)} cannot be read "
                             f"({type(error).__name__}: {error})")
                continue
            expected += [r for r in (record.get("args") or {}).get("runs") or []
                         if r not in expected]
            for run in found:
                if run.get("name") in runs:
                    notes.append(f"run {run['name']} is also in {path.relative_to(directory)}: "
                                 "kept the first")
                    continue
                run["args"] = record.get("args") or {}
                runs[run.get("name", path.stem)] = run
    for name in ORDER:  # a variant's log or output directory, but no metrics
        if (directory / f"{name}.log").is_file() or (directory / name).is_dir():
            expected += [name] if name not in expected else []
    missing = [name for name in expected if name not in runs]
    if missing:
        notes.insert(0, "no metrics for " + ", ".join(
            f"{name} (see {name}.log)" if (directory / f"{name}.log").is_file() else name
            for name in missing) + ": the run failed, was cut, or was not run")
    if not runs:
        raise SystemExit(f"no metrics under {directory} (looked for {', '.join(PATTERNS)})"
                         + "".join(f"; {note}" for note in notes))
    return _in_order(runs)


def _in_order(runs: Dict[str, Dict]) -> Dict[str, Dict]:
    """``runs`` in the table's order: dense, msa, random, local, then any other."""
    return dict(sorted(runs.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER
                       else 9))


def runs_of_record(record: Dict) -> Dict[str, Dict]:
    """``{run name: run record}`` of one ``metrics.json`` record as
    ``examples/pretrain_tiny.py`` writes it (``{"args": {...}, "runs": [{"name": ...}, ...]}``),
    each run given the record's ``args``, in the table's order (what :func:`table` and
    :func:`report_text` read). Raises TypeError when ``record`` has no list of runs."""
    found = record.get("runs") if isinstance(record, dict) else None
    if not isinstance(found, list):
        raise TypeError("record must be a metrics.json record with a list 'runs', got "
                        f"{type(record).__name__}")
    args = record.get("args") or {}
    return _in_order({run.get("name", f"run{i}"): dict(run, args=args)
                      for i, run in enumerate(found)})


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def load_summary(path: Path) -> Dict[str, Dict]:
    """``{run name: run record}`` from a ``retrieval.json`` written by :func:`main` (the
    records hold what the table and the plot read: no per-step loss or speed, but
    ``median_tokens_per_s``). Raises SystemExit when the file cannot be read or is no such
    summary."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"--from-json {path} cannot be read ({type(error).__name__}: {error})")
    if (not isinstance(summary, dict) or not summary
            or not all(isinstance(run, dict) and "args" in run for run in summary.values())):
        raise SystemExit(f"--from-json {path} is not a retrieval.json of this script (one record "
                         "with 'args' per run name)")
    runs = {name: dict(run, name=name, args=run.get("args") or {})
            for name, run in summary.items()}
    return _in_order(runs)


def is_text(run: Dict) -> bool:
    """Whether ``run`` trained on ``--task text`` (no questions, no held-out retrieval
    metrics)."""
    return (run.get("args") or {}).get("task") == "text"


# Text runs: besides the last probe's recall, the mean over this many last probes after the
# dense -> sparse switch (one probe reads 256 rows of one training window: it moves by about
# 0.02-0.1 from probe to probe, the first layer most).
LAST_PROBES = 4


def last_probes(run: Dict, count: int = LAST_PROBES) -> List[Tuple[Optional[int], float]]:
    """``(probe step, recall as the mean over layers)`` of the last ``count`` selection probes
    of ``run`` after its dense warm-up (``--warmup-steps``; all probes when none is after it),
    oldest first; steps are None when the run has no ``probe_steps`` of the same length.

    Raises ValueError when ``count`` < 1."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    recall = run.get("recall_per_layer") or []
    steps = run.get("probe_steps") or []
    if len(steps) != len(recall):
        steps = [None] * len(recall)
    probes = [(step, _mean(values)) for step, values in zip(steps, recall) if values]
    warmup = int((run.get("args") or {}).get("warmup_steps") or 0)
    after = [(step, value) for step, value in probes if step is not None and step > warmup]
    return (after or probes)[-count:]


def final_values(run: Dict) -> Dict:
    """The values of the table's columns for ``run``: its held-out retrieval metrics; for a
    ``--task text`` run (no questions) the recall and best recall of its last selection probe
    and the recall's mean over the last :data:`LAST_PROBES` probes after the warm-up
    (``recall_last_probes``; means over layers; empty when it has no probe)."""
    if not is_text(run):
        return run.get("retrieval") or {}
    recall, best = run.get("recall_per_layer") or [], run.get("recall_best_per_layer") or []
    values = {}
    if recall and recall[-1]:
        values["recall"] = _mean(recall[-1])
    tail = last_probes(run)
    if tail:
        values["recall_last_probes"] = _mean([value for _, value in tail])
    if best and best[-1]:
        values["recall_best"] = _mean(best[-1])
    return values


def probe_note(runs: Dict[str, Dict]) -> str:
    """The table's note on runs whose recall comes from the training probe ("" when none)."""
    probed = [(name, (run.get("probe_steps") or [None])[-1], last_probes(run))
              for name, run in runs.items() if is_text(run) and final_values(run)]
    if not probed:
        return ""
    steps = sorted({step for _, step, _ in probed if step is not None})
    at = f" (step {', '.join(map(str, steps))})" if steps else ""

    def span(count: int, first: Optional[int], last: Optional[int]) -> str:
        if first is None:
            return f"{count} probe" + "s" * (count > 1)
        return f"1 probe, step {first}" if count == 1 else f"{count} probes, steps {first}-{last}"

    spans = "; ".join(span(*key) for key in sorted(
        {(len(tail), tail[0][0], tail[-1][0]) for _, _, tail in probed if tail},
        key=lambda key: (key[0], key[1] or 0)))
    return (f"{', '.join(name for name, _, _ in probed)}: no questions (--task text): recall and "
            f"best recall are the last selection probe's{at}, on a training window, not held "
            f"out; \"recall, mean of last {LAST_PROBES} probes\" averages the last probes after "
            f"the dense warm-up ({spans}: one probe moves by about 0.02-0.1, the first layer "
            "most); the retrieval-only columns read -.")


def last_step(run: Dict) -> Optional[int]:
    """The run's last training step (from its step history, else its ``--steps``)."""
    steps = run.get("steps") or []
    return steps[-1] if steps else (run.get("args") or {}).get("steps")


def own_speeds(run: Dict) -> List[float]:
    """Tokens/s of the steps this variant trained itself: those after the shared dense warm-up
    (a run that loaded the warm-up carries the warm-up's step history too), all steps when the
    run has no warm-up (then the second half, past compilation)."""
    speeds, steps = run.get("tokens_per_s") or [], run.get("steps") or []
    warmup = int((run.get("args") or {}).get("warmup_steps") or 0)
    own = [v for step, v in zip(steps, speeds) if step > warmup] if warmup else []
    return own or speeds[len(speeds) // 2:]


# Held-out columns of the comparison table: (retrieval key, header). Those marked optional
# appear only when some run measured them (runs stored before they existed read the same).
COLUMNS = [("exact_match", "exact match", False), ("answer_loss", "answer loss", False),
           ("recall", "recall", False),
           ("recall_last_probes", f"recall, mean of last {LAST_PROBES} probes", True),
           ("recall_best", "best recall", True),
           ("recall_answer", "recall, answer rows", False),
           ("key_hit", "record block chosen", False),
           ("key_hit_any", "by some layer and head", True)]


def table(runs: Dict[str, Dict]) -> str:
    """Markdown comparison table (held-out values at the end of training). "best recall": the
    share the best selection the rules allow would hold (the recall's ceiling); "by some layer
    and head": share of questions whose record block at least one layer's index head chose."""
    measured = {key for run in runs.values() for key in final_values(run)}
    columns = [(key, header) for key, header, optional in COLUMNS
               if not optional or key in measured]
    lines = ["| run | " + " | ".join(header for _, header in columns)
             + " | held-out LM loss | tokens/s |",
             "|---" * (len(columns) + 3) + "|"]
    for name, run in runs.items():
        r = final_values(run)

        def cell(key: str) -> str:
            value = r.get(key)
            return f"{value:.3f}" if isinstance(value, (int, float)) else "-"

        speeds = own_speeds(run)
        median = statistics.median(speeds) if speeds else run.get("median_tokens_per_s")
        speed = f"{median:,.0f}" if isinstance(median, (int, float)) else "-"
        loss = run.get("held_out_loss")
        loss = f"{loss:.3f}" if isinstance(loss, (int, float)) else "-"
        lines.append(f"| {LABELS.get(name, name)} | "
                     + " | ".join(cell(key) for key, _ in columns) + f" | {loss} | {speed} |")
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
    drawn = set()  # the shared warm-up part of each curve is drawn once, in grey

    def draw(ax, steps, values, color, label, key, **style):
        cut = int(warmup or 0)
        shared = [(s, v) for s, v in zip(steps, values) if s <= cut]
        own = shared[-1:] + [(s, v) for s, v in zip(steps, values) if s > cut]
        if shared and key not in drawn:
            drawn.add(key)
            ax.plot(*zip(*shared), color=WARMUP_COLOR, label=f"dense warm-up: {key}", **style)
        if len(own) > len(shared[-1:]):
            ax.plot(*zip(*own), color=color, label=label, **style)

    for name, run in runs.items():
        color = COLORS.get(name)
        warmup = run["args"].get("warmup_steps", warmup)
        steps, matches = list(run.get("eval_steps") or []), list(run.get("eval_exact_match") or [])
        final, end = (run.get("retrieval") or {}).get("exact_match"), last_step(run)
        if isinstance(final, (int, float)) and end and (not steps or end > steps[-1]):
            steps, matches = steps + [end], matches + [final]  # the end of training
        draw(ax_acc, steps, matches, color, LABELS.get(name, name), "exact match", marker=".")
        probed = run.get("probe_steps") or []
        curves = (("recall_per_layer", "-", "recall (uniform rows)"),
                  ("key_hit_per_layer", ":", "record block chosen"))
        if is_text(run):  # no questions, no record block: the recall's ceiling instead
            curves = (curves[0], ("recall_best_per_layer", "--", "best recall"))
        for key, style, what in curves:
            values = run.get(key) or []
            if probed and name != "local" and len(values) == len(probed):
                draw(ax_recall, probed, [_mean(v) for v in values], color, f"{name}: {what}",
                     what, linestyle=style)
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
            ax.axvline(int(warmup) + 0.5, color="black", linewidth=0.8, label="dense -> sparse")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_acc.set_title("held-out exact match of the answers")
    ax_recall.set_title("index selection vs dense teacher")
    ax_hist.set_title("selected blocks by distance from the query's block")
    if all(is_text(run) for run in runs.values()):
        ax_acc.text(0.5, 0.5, "no questions (--task text)", ha="center", transform=ax_acc.transAxes)
        ax_hist.text(0.5, 0.5, "no held-out probe (--task text)", ha="center",
                     transform=ax_hist.transAxes)
    ax_hist.set_ylabel("share of selected blocks")
    if ax_hist.get_legend_handles_labels()[0]:
        ax_hist.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, nargs="?",
                        help="OUT of run_retrieval.sh, runs/<name> of gpu_retrieval_chain.sh, "
                             "a benchmarks/results directory or the --out-dir of one "
                             "pretrain_tiny.py run")
    parser.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                        help="redraw the table and the plot from a retrieval.json this script "
                             "wrote (instead of a directory): FILE's stem .md and .png")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="with --from-json: write there (default: beside FILE)")
    args = parser.parse_args(argv)
    if (args.directory is None) == (args.from_json is None):
        parser.error("give a directory or --from-json FILE (one of them)")
    if args.out_dir is not None and args.from_json is None:
        parser.error("--out-dir goes with --from-json (a directory's report is written there)")
    if args.from_json is not None:
        return report_from_json(args.from_json, args.out_dir)
    notes: List[str] = []
    runs = load_runs(args.directory, notes)
    summary = {name: {key: run.get(key) for key in (
        "retrieval", "held_out_loss", "eval_steps", "eval_exact_match", "probe_steps",
        "recall_per_layer", "recall_answer_per_layer", "key_hit_per_layer",
        "key_hit_per_head", "seconds",
        "args")} for name, run in runs.items()}
    for name, run in runs.items():  # measured by newer runs only: absent rather than null
        summary[name].update({key: run[key] for key in ("recall_best_per_layer", "key_hit_any")
                              if run.get(key)})
    for name, run in runs.items():  # training answer loss, mean per 10 steps; step time
        losses, steps = run.get("answer_loss") or [], run.get("steps") or []
        summary[name]["answer_loss_steps"] = steps[9::10]
        summary[name]["answer_loss"] = [sum(losses[i:i + 10]) / len(losses[i:i + 10])
                                        for i in range(0, len(losses) - 9, 10)]
        speeds = own_speeds(run)
        summary[name]["median_tokens_per_s"] = statistics.median(speeds) if speeds else None
    (args.directory / "retrieval.json").write_text(json.dumps(summary, indent=1))
    text = report_text(runs, notes)
    (args.directory / "retrieval.md").write_text(text + "\n")
    plot(runs, args.directory / "retrieval.png")
    print(text)
    print(f"wrote {args.directory / 'retrieval.json'}, retrieval.md and retrieval.png")
    return 0


def report_text(runs: Dict[str, Dict], notes: List[str]) -> str:
    """The markdown of retrieval.md: the table, its note on text runs, the per-head table and
    the ``notes`` on what is missing."""
    text = table(runs)
    note = probe_note(runs)
    if note:
        text += "\n\n" + note
    heads = head_table(runs)
    if heads:
        text += ("\n\nRecord block chosen per layer (L) and index head (h), held out:\n\n"
                 + heads)
    elif any(run.get("retrieval") for run in runs.values()):
        notes.append("no run has key_hit_per_head (record block chosen per layer and index "
                     "head; metrics.json written before it existed): no per-head table")
    if notes:
        text += "\n\nMissing:\n\n" + "\n".join(f"- {note}" for note in notes)
    return text


def report_from_json(path: Path, out_dir: Optional[Path] = None) -> int:
    """``--from-json``: the table (``<stem>.md``) and the plot (``<stem>.png``) of the
    ``retrieval.json`` at ``path``, beside it or in ``out_dir``. Raises SystemExit when the file
    is not such a summary."""
    runs = load_summary(path)
    out_dir = path.parent if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    text = report_text(runs, [])
    (out_dir / f"{path.stem}.md").write_text(text + "\n")
    plot(runs, out_dir / f"{path.stem}.png")
    print(text)
    print(f"wrote {out_dir / (path.stem + '.md')} and {path.stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
