"""benchmarks/provenance.py: a result names its commit, and says when the files differ from it."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.scripts import load_script


def _load():
    return load_script("benchmarks/provenance.py")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_dirty_and_unknown(tmp_path, monkeypatch):
    provenance = _load()
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "a.txt").write_text("1\n")
    subprocess.run(git + ["add", "a.txt"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.setattr(provenance, "_REPO", str(repo))
    assert provenance.git_commit() == head
    (repo / "a.txt").write_text("2\n")  # a tracked file differs from HEAD
    assert provenance.git_commit() == head + "+dirty"
    monkeypatch.setattr(provenance, "_REPO", str(tmp_path / "missing"))
    assert provenance.git_commit() == "unknown"
