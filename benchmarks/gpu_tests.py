"""Run pytest units side by side under one deadline: the multi-rank tests on GPUs in minutes.

Every test of ``tests/megatron`` starts its ranks in fresh processes (NCCL, one GPU per rank), so
one pytest process spends most of its time starting processes, not computing; several pytest
processes side by side on the same GPUs keep them busy. A *unit* is one pytest process: a test
file, one test function of a file named by ``--split``, or the node ids given to one ``--unit``
(run in that order in one process, so the first warms the Triton cache for the others). Units
start in this order on ``--jobs`` workers: ``--unit`` units, split files, then whole files as
listed (name the slow ones first). A unit still running at the deadline gets SIGINT (pytest
prints what it has), then SIGKILL. The log holds every unit's output and a summary; the exit status is 0 when every
unit ran and passed.

Usage (from the repository root; see benchmarks/gpu_integration.sh)::

    python3 benchmarks/gpu_tests.py LOG --jobs 6 --deadline-s 400 --backend torch \\
        --split test_megatron_tp.py --unit "triton=tests/megatron/test_megatron_modes.py" \\
        tests/megatron

Environment of every unit: ``MSA_TEST_DEVICE=cuda`` (``--device``), ``MSA_TEST_BACKEND`` (the
unit's backend).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PYTEST_ARGS = ["-q", "-rfEs", "-p", "no:cacheprovider", "--disable-warnings",
               "--durations=10", "--durations-min=1"]
COUNT_WORDS = ("passed", "failed", "skipped", "error", "errors", "xfailed", "xpassed")
GRACE_S = 20.0      # between SIGINT and SIGKILL at the deadline
MIN_START_S = 20.0  # a unit is not started with less time than this left
POLL_S = 0.2


@dataclass
class Unit:
    """One pytest process: its node ids (files, ``file::function`` or full node ids), backend."""

    backend: str
    node_ids: List[str]
    name: str = ""
    rc: Optional[int] = None
    seconds: float = 0.0
    output: str = ""
    status: str = "not run"  # not run | done | timed out
    counts: Dict[str, int] = field(default_factory=dict)


def test_functions(path: Path) -> List[str]:
    """The ``test_*`` functions defined at module level in ``path``, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    text = path.read_text()
    return re.findall(r"^def (test_\w+)\s*\(", text, flags=re.MULTILINE)


def test_files(paths: Sequence[str]) -> List[Path]:
    """Test files named by ``paths``, in order, each once: a file as given, a directory its
    ``test_*.py`` not named before (sorted), so ``dir/test_slow.py dir`` runs the slow one first.

    Raises:
        FileNotFoundError: a path that does not exist.
    """
    files: List[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            found = sorted(path.glob("test_*.py"))
        elif path.is_file():
            found = [path]
        else:
            raise FileNotFoundError(f"no test file or directory {text!r}")
        files.extend(f for f in found if f.resolve() not in {g.resolve() for g in files})
    return files


def plan_units(paths: Sequence[str], backend: str, split: Sequence[str],
               extra: Sequence[str]) -> List[Unit]:
    """The units to run, in start order.

    Args:
        paths: test files or directories run with ``backend`` (:func:`test_files`), one unit
            per file, or one per test function for a file whose name is in ``split``.
        backend: ``MSA_TEST_BACKEND`` of those units.
        split: file names (``test_x.py``) to run one test function per unit.
        extra: ``"BACKEND=NODEID[ NODEID...]"`` units, run first.

    Raises:
        ValueError: an ``extra`` entry without ``BACKEND=`` or without node ids.
    """
    units: List[Unit] = []
    for spec in extra:
        backend_of, sep, ids = spec.partition("=")
        node_ids = ids.split()
        if not sep or not backend_of.strip() or not node_ids:
            raise ValueError(f"--unit must be 'BACKEND=NODEID [NODEID ...]', got {spec!r}")
        units.append(Unit(backend_of.strip(), node_ids))
    whole: List[Unit] = []
    for path in test_files(paths):
        if path.name in split:
            units.extend(Unit(backend, [f"{path}::{name}"]) for name in test_functions(path))
        else:
            whole.append(Unit(backend, [str(path)]))
    units.extend(whole)
    for unit in units:
        unit.name = f"[{unit.backend}] " + " ".join(unit.node_ids)
    return units


def summary_counts(output: str) -> Dict[str, int]:
    """The counts of pytest's last summary line (``3 passed, 1 skipped in 9.1s``), or ``{}``."""
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (" + "|".join(COUNT_WORDS) + r")\b", line)
        if found and (" in " in line or line.startswith("=")):
            counts: Dict[str, int] = {}
            for number, word in found:
                word = "errors" if word == "error" else word
                counts[word] = counts.get(word, 0) + int(number)
            return counts
    return {}


def unit_passed(unit: Unit) -> bool:
    """Ran to the end with pytest's status 0 (5, nothing collected, counts as a failure)."""
    return unit.status == "done" and unit.rc == 0


def _start(unit: Unit, device: str, log_dir: Path, index: int):
    env = dict(os.environ, MSA_TEST_DEVICE=device, MSA_TEST_BACKEND=unit.backend)
    out_path = log_dir / f"unit{index:02d}.out"
    handle = open(out_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *PYTEST_ARGS, *unit.node_ids],
                            stdout=handle, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, handle, out_path


def run_units(units: List[Unit], jobs: int, deadline: float, device: str, log_dir: Path,
              echo=print) -> None:
    """Run ``units`` on ``jobs`` workers until done or ``deadline`` (``time.monotonic()``);
    fills each unit's ``rc``, ``status``, ``seconds``, ``output``, ``counts``."""
    pending = list(enumerate(units))
    running: Dict[int, tuple] = {}
    try:
        _run_loop(units, pending, running, jobs, deadline, device, log_dir, echo)
    finally:  # SIGTERM or an error here: leave no pytest (or its ranks) behind
        for proc, handle, _, _ in running.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            handle.close()


def _run_loop(units, pending, running, jobs, deadline, device, log_dir, echo) -> None:
    interrupted: Dict[int, float] = {}
    while pending or running:
        now = time.monotonic()
        while pending and len(running) < jobs and deadline - now > MIN_START_S:
            index, unit = pending.pop(0)
            running[index] = (*_start(unit, device, log_dir, index), now)
        if not running:
            break  # too little time left to start the rest
        for index in list(running):
            proc, handle, out_path, started = running[index]
            unit = units[index]
            if proc.poll() is None:
                if now >= deadline and index not in interrupted:
                    os.killpg(proc.pid, signal.SIGINT)
                    interrupted[index] = now
                elif index in interrupted and now - interrupted[index] > GRACE_S:
                    os.killpg(proc.pid, signal.SIGKILL)
                continue
            handle.close()
            try:  # ranks left behind by an interrupted unit
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            unit.rc, unit.seconds = proc.returncode, now - started
            unit.status = "timed out" if index in interrupted else "done"
            unit.output = out_path.read_text(errors="replace")
            unit.counts = summary_counts(unit.output)
            del running[index]
            echo(f"{'PASS' if unit_passed(unit) else 'FAIL'} {unit.name} "
                 f"({unit.status}, rc={unit.rc}, {unit.seconds:.0f} s) {unit.counts}")
        time.sleep(POLL_S)


def report(units: List[Unit], wall_s: float) -> str:
    """The summary block: one line per unit, then the totals and the verdict."""
    lines = ["=== summary (units in start order)"]
    totals: Dict[str, int] = {}
    for unit in units:
        for word, number in unit.counts.items():
            totals[word] = totals.get(word, 0) + number
        verdict = "PASS" if unit_passed(unit) else "FAIL"
        if unit.status == "not run":
            verdict = "NOT RUN"
        lines.append(f"{verdict:7s} {unit.seconds:6.0f} s  rc={unit.rc}  {unit.name}  "
                     f"{unit.counts}")
    ok = all(unit_passed(unit) for unit in units)
    text = ", ".join(f"{n} {w}" for w, n in sorted(totals.items()))
    lines.append(f"TESTS {'PASS' if ok else 'FAIL'}: {text or 'nothing ran'} "
                 f"({len(units)} units, wall {wall_s:.0f} s)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="log file (every unit's output, then the summary)")
    parser.add_argument("paths", nargs="*", help="test files or directories (--backend)")
    parser.add_argument("--backend", default="torch", help="MSA_TEST_BACKEND of the paths")
    parser.add_argument("--split", action="append", default=[],
                        help="file name run one test function per unit (repeatable)")
    parser.add_argument("--unit", action="append", default=[],
                        help="'BACKEND=NODEID [NODEID ...]': one unit, run first (repeatable)")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=400.0,
                        help="seconds from now after which running units are interrupted")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_intermixed_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    start = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs run_units' clean-up
    units = plan_units(args.paths, args.backend, args.split, args.unit)
    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="gpu_tests_"))  # one output file per unit
    print(f"{len(units)} units on {args.jobs} workers, deadline {args.deadline_s:.0f} s",
          flush=True)
    run_units(units, args.jobs, start + args.deadline_s, args.device, log_dir,
              echo=lambda line: print(line, flush=True))
    summary = report(units, time.monotonic() - start)
    with open(log, "w") as out:
        for unit in units:
            out.write(f"=== {unit.name} ({unit.status}, rc={unit.rc}, {unit.seconds:.0f} s)\n")
            out.write(unit.output + "\n")
        out.write(summary + "\n")
    print(summary, flush=True)
    return 0 if all(unit_passed(unit) for unit in units) else 1


if __name__ == "__main__":
    sys.exit(main())
