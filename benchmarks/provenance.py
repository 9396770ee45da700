"""Where a benchmark result came from: the git commit of the code that ran.

Shared by the benchmark scripts (``bench_kernels.py``, ``bench_cp.py``, ``long_check.py``) so
that every JSON names its code the same way.
"""

from __future__ import annotations

import os
import subprocess

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The commit of HEAD of the repository holding this file, with ``+dirty`` appended when
    tracked files differ from it (a copy of a working tree run on another machine can carry
    git metadata older than its files; the suffix says the commit alone does not name the
    code). ``"unknown"`` where git or the repository is missing."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=_REPO,
                               capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
