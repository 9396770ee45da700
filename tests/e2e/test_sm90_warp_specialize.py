"""benchmarks/sm90_warp_specialize.py: how a compile is classified (specialised with the
consumers' product rows, skipped, or failing with the compiler's assertion line), on stand-ins
for the compiler and the per-case process; the real compiles need the GPU machine's Triton."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from tests.support.scripts import load_script


def _load():
    return load_script("benchmarks/sm90_warp_specialize.py")


def _fake_compile(ttgir: str, warps: int):
    def compile_(src, target, options):
        assert target.arch == 90 and options["num_warps"] in (4, 8)
        return SimpleNamespace(asm={"ttgir": ttgir},
                               metadata=SimpleNamespace(shared=1024, num_warps=warps))
    return compile_


def test_specialised_reports_the_consumers_rows(monkeypatch):
    ws = _load()
    ttgir = ("ttg.warp_specialize(%a)\n"
             "%1 = ttng.warp_group_dot %x, %y, %z : a * b -> tensor<64x64xf32, #mma>\n"
             "%2 = ttng.warp_group_dot %x, %y, %z : a * b -> tensor<64x128xf32, #mma1>\n")
    monkeypatch.setattr(ws.triton, "compile", _fake_compile(ttgir, 12))
    line = ws.compile_case("plain")
    assert line.startswith("specialised") and "warps 12" in line and "wgmma M [64]" in line


def test_plain_kernel_is_skipped(monkeypatch):
    ws = _load()
    ttgir = "%1 = ttng.warp_group_dot %x, %y, %z : a * b -> tensor<128x64xf32, #mma>\n"
    monkeypatch.setattr(ws.triton, "compile", _fake_compile(ttgir, 8))
    assert ws.compile_case("warps8").startswith("skipped      warps 8 BM 128: warps 8")


def test_failure_line_is_the_assertion(monkeypatch):
    ws = _load()
    stderr = ("module {\n}\n"
              "python: WSDataPartition.cpp:1197: Assertion `reduce should not happen' failed.\n"
              "x.py:1:0: error: Failures have been detected\n")

    def run(*args, **kwargs):
        return subprocess.CompletedProcess(args, -6, stdout="", stderr=stderr)

    monkeypatch.setattr(ws.subprocess, "run", run)
    line = ws.run_case("row_sum_after")
    assert line.startswith("FAILS") and "Assertion" in line and "error:" not in line


def test_success_line_passes_through(monkeypatch):
    ws = _load()

    def run(*args, **kwargs):
        return subprocess.CompletedProcess(args, 0, stdout="noise\nspecialised  x\n", stderr="")

    monkeypatch.setattr(ws.subprocess, "run", run)
    assert ws.run_case("plain") == "specialised  x"


@pytest.mark.parametrize("argv", [["nope"], ["plain", "nope"]])
def test_unknown_case(argv, capsys):
    assert _load().main(argv) == 2
    assert "unknown case(s) ['nope']" in capsys.readouterr().out
