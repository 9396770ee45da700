"""The shell launchers answer ``--help`` / ``--check-only`` and missing GPUs without installing
or starting anything: ``examples/run_tiny.sh`` and the Megatron-LM kit's launchers.

Every interpreter, ``nvidia-smi`` and ``torchrun`` the scripts could call is a stand-in that
logs its arguments, so a test sees exactly what would have been run (a pip install, a venv, a
torchrun launch) and never runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_TINY = REPO / "examples" / "run_tiny.sh"
KIT = REPO / "examples" / "megatron_lm"
GUARD_S = 300  # subprocess guard only

# The tools the launchers use besides bash builtins (a PATH of only these has no nvidia-smi).
TOOLS = ("dirname", "realpath", "grep", "head", "sed", "cat")


def _stub(path: Path, log: Path, status: int = 0, output: str = "") -> None:
    """An executable that appends ``name args...`` to ``log``, prints ``output``, exits
    ``status``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{path.name} $*" >> "{log}"\n'
                    + (f"echo '{output}'\n" if output else "") + f"exit {status}\n")
    path.chmod(0o755)


def _bare_path(tmp_path: Path) -> Path:
    """A directory with only :data:`TOOLS` (symlinks), to be the whole PATH."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bare / tool).symlink_to(found)
    return bare


@pytest.fixture
def sandbox(tmp_path):
    """``(env, log)``: PATH = stubs (a python3 that cannot import torch, torchrun, pip) + the
    bare tools; VENV names a directory that does not exist."""
    log = tmp_path / "calls.log"
    stubs = tmp_path / "stubs"
    _stub(stubs / "python3", log, status=1)  # no torch: not a usable interpreter
    _stub(stubs / "torchrun", log)
    _stub(stubs / "pip", log)
    env = {"PATH": f"{stubs}{os.pathsep}{_bare_path(tmp_path)}", "HOME": str(tmp_path),
           "VENV": str(tmp_path / "venv-not-made")}
    return env, log


def _calls(log: Path) -> list:
    return log.read_text().splitlines() if log.exists() else []


def _run(script: Path, env: dict, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(script), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=GUARD_S)


def _nothing_installed_or_launched(env: dict, log: Path) -> None:
    calls = "\n".join(_calls(log))
    assert "-m venv" not in calls and "pip" not in calls, calls
    assert "torch.distributed.run" not in calls and "torchrun" not in calls, calls
    assert not Path(env["VENV"]).exists()


# --- examples/run_tiny.sh -----------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_run_tiny_help_installs_nothing(sandbox, flag):
    env, log = sandbox
    proc = _run(RUN_TINY, env, "--steps", "3", flag)
    assert proc.returncode == 0, proc.stderr
    assert "TORCH_SPEC" in proc.stdout and "--check-only" in proc.stdout  # the usage text
    assert "options are listed once" in proc.stdout  # no interpreter: says where they are
    assert proc.stderr == ""
    _nothing_installed_or_launched(env, log)


def test_run_tiny_check_only_runs_the_check_in_one_process(sandbox, tmp_path):
    env, log = sandbox
    venv = tmp_path / "venv"
    _stub(venv / "bin" / "python", log)  # a set-up venv whose python "imports" everything
    env = dict(env, VENV=str(venv), NPROC="8")
    proc = _run(RUN_TINY, env, "--check-only", "--quick", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    calls = _calls(log)
    checks = [c for c in calls if "pretrain_tiny.py" in c]
    assert checks == ["python examples/pretrain_tiny.py --tp 2 --cp 2 --device cpu --quick "
                      "--steps 3 --check-only"], calls
    assert not [c for c in calls if "pip" in c or "venv" in c or "distributed.run" in c], calls


def test_run_tiny_check_only_without_an_environment_says_what_it_checked(sandbox):
    env, log = sandbox
    proc = _run(RUN_TINY, env, "--check-only")
    assert proc.returncode == 0, proc.stderr
    assert "TP=2 CP=2 NPROC=4 DEVICE=cpu OK" in proc.stdout
    assert "were not checked" in proc.stdout
    _nothing_installed_or_launched(env, log)


def test_run_tiny_check_only_with_a_real_interpreter(sandbox, tmp_path):
    env, log = sandbox
    env = dict(env, PYTHON=sys.executable, TP="1", CP="2",
               PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    proc = _run(RUN_TINY, env, "--check-only", "--quick", "--out-dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "settings OK for 2 processes" in proc.stdout
    bad = _run(RUN_TINY, env, "--check-only", "--quick", "--seq-len", "100")
    assert bad.returncode == 2 and "--seq-len 100" in bad.stderr, bad.stderr[-2000:]
    _nothing_installed_or_launched(env, log)


@pytest.mark.parametrize("setting, message", [
    ({"CP": "3"}, "CP=3 must be 1, 2, 4 or 8"),
    ({"NPROC": "6"}, "NPROC=6 must be a multiple of TP x CP = 2 x 2 = 4"),
    ({"TP": "0"}, "TP=0 must be a positive integer"),
    ({"DEVICE": "gpu"}, "DEVICE=gpu must be cpu or cuda"),
    ({"DEVICE": "cuda"}, "DEVICE=cuda but nvidia-smi lists no NVIDIA GPU"),
])
@pytest.mark.parametrize("mode", [[], ["--check-only"]])
def test_run_tiny_bad_layout_is_one_line_before_anything(sandbox, setting, message, mode):
    env, log = sandbox
    proc = _run(RUN_TINY, dict(env, **setting), *mode)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"examples/run_tiny.sh: {message}"), lines
    _nothing_installed_or_launched(env, log)


@pytest.mark.parametrize("visible,ok", [(None, True), ("1", True), ("", False), (" , ", False)])
def test_run_tiny_cuda_counts_gpus_as_the_megatron_launchers(sandbox, tmp_path, visible, ok):
    """One count for both (examples/gpu_count.sh): GPUs nvidia-smi lists, hidden ones left out."""
    env, log = sandbox
    listing = "GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)"
    _stub(tmp_path / "stubs" / "nvidia-smi", log, output=listing)
    env = dict(env, DEVICE="cuda")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    proc = _run(RUN_TINY, env, "--check-only")
    if ok:
        assert proc.returncode == 0 and "DEVICE=cuda OK" in proc.stdout, proc.stderr
    else:
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "DEVICE=cuda but no GPU is visible" in lines[0], lines
    _nothing_installed_or_launched(env, log)


# --- examples/megatron_lm launchers -------------------------------------------------------

LAUNCHERS = {
    "train_single_node.sh": {},
    "train_multi_node.sh": {"NNODES": "2", "RDZV_HOST": "node0"},
}


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
@pytest.mark.parametrize("smi", [None, ("No devices were found", 6), ("", 0)],
                         ids=["no-nvidia-smi", "no-devices", "empty-list"])
def test_megatron_launchers_without_gpus_say_so(sandbox, tmp_path, name, smi):
    env, log = sandbox
    if smi is not None:
        _stub(tmp_path / "stubs" / "nvidia-smi", log, status=smi[1], output=smi[0])
    env = dict(env, OUT_DIR=str(tmp_path / "out"), **LAUNCHERS[name])
    proc = _run(KIT / name, env, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: no GPU found"), proc.stderr
    assert "command not found" not in proc.stderr
    assert not [c for c in _calls(log) if c.startswith("torchrun")]


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_megatron_launchers_take_gpus_per_node(sandbox, tmp_path, name):
    env, log = sandbox
    env = dict(env, OUT_DIR=str(tmp_path / "out"), GPUS_PER_NODE="3", **LAUNCHERS[name])
    proc = _run(KIT / name, env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (launch,) = [c for c in _calls(log) if c.startswith("torchrun")]
    assert "--nproc-per-node 3 " in launch
    bad = _run(KIT / name, dict(env, GPUS_PER_NODE="two"), cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"{name}: GPUS_PER_NODE=two must be a positive integer"


def test_megatron_launchers_count_listed_gpus(sandbox, tmp_path):
    env, log = sandbox
    listing = "GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)"
    _stub(tmp_path / "stubs" / "nvidia-smi", log, output=listing)
    proc = _run(KIT / "train_single_node.sh", dict(env, OUT_DIR=str(tmp_path / "out")),
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (launch,) = [c for c in _calls(log) if c.startswith("torchrun")]
    assert "--nproc-per-node 2 " in launch


def test_slurm_script_outside_slurm_says_so(sandbox, tmp_path):
    env, log = sandbox
    proc = _run(KIT / "train_slurm.sbatch", env, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not inside a Slurm job" in lines[0], proc.stderr
    assert not [c for c in _calls(log) if c.startswith("torchrun")]


@pytest.mark.parametrize("visible,want", [("0", 1), ("1,3", 2), ("0,1,2,3,4,5,6,7,8", 8), ("", 0)])
def test_megatron_launchers_count_only_visible_gpus(sandbox, tmp_path, visible, want):
    env, log = sandbox
    listing = "\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})" for i in range(8))
    _stub(tmp_path / "stubs" / "nvidia-smi", log, output=listing)
    env = dict(env, OUT_DIR=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES=visible)
    proc = _run(KIT / "train_single_node.sh", env, cwd=tmp_path)
    if want == 0:
        assert proc.returncode == 2 and "no GPU visible" in proc.stderr, proc.stderr
        assert not [c for c in _calls(log) if c.startswith("torchrun")]
        return
    assert proc.returncode == 0, proc.stderr
    (launch,) = [c for c in _calls(log) if c.startswith("torchrun")]
    assert f"--nproc-per-node {want} " in launch
