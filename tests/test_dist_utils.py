"""The multi-rank test harness itself (tests/dist_utils.py): how ranks start (fork on CPU, a fork
server on CUDA that preloads the heavy imports, spawn when that fails) and that a rank sees the
environment of the moment it was started, whichever way it starts."""

from __future__ import annotations

import os

import pytest

from tests import dist_utils
from tests.dist_utils import DistributedTestError, run_distributed, start_method


def _read_env(rank: int, world_size: int, name: str) -> tuple:
    import sys

    return os.environ.get(name), "megatron.core" in sys.modules


def test_default_start_methods(monkeypatch):
    monkeypatch.delenv(dist_utils.START_ENV, raising=False)
    monkeypatch.setattr(dist_utils, "_forkserver_failed", False)
    assert start_method("cpu") == "fork"
    assert start_method("cuda") == "forkserver"
    monkeypatch.setattr(dist_utils, "_forkserver_failed", True)
    assert start_method("cuda") == "spawn"


def test_start_method_from_the_environment(monkeypatch):
    monkeypatch.setattr(dist_utils, "_forkserver_failed", False)
    monkeypatch.setenv(dist_utils.START_ENV, "Spawn")
    assert start_method("cpu") == "spawn"
    monkeypatch.setenv(dist_utils.START_ENV, "fork")
    with pytest.raises(ValueError, match="CUDA"):
        start_method("cuda")
    monkeypatch.setenv(dist_utils.START_ENV, "thread")
    with pytest.raises(ValueError, match="MSA_TEST_START"):
        start_method("cpu")


def test_forkserver_ranks_see_the_current_environment_and_preloaded_imports(monkeypatch):
    """The fork server is started once with the environment of that moment; a rank must still
    see a variable set afterwards (tests set ``$MSA_CONFIG`` with monkeypatch before a run)."""
    monkeypatch.setenv(dist_utils.START_ENV, "forkserver")
    monkeypatch.setattr(dist_utils, "_forkserver_failed", False)
    monkeypatch.setenv("MSA_DIST_UTILS_PROBE", "first")
    assert run_distributed(_read_env, 2, args=("MSA_DIST_UTILS_PROBE",), device="cpu") == \
        [("first", True), ("first", True)]
    monkeypatch.setenv("MSA_DIST_UTILS_PROBE", "second")
    assert run_distributed(_read_env, 1, args=("MSA_DIST_UTILS_PROBE",), device="cpu") == \
        [("second", True)]


def test_cuda_fork_failure_falls_back_to_spawn(monkeypatch):
    """A fork server whose children cannot start CUDA is given up for spawn, once and for the
    rest of the session; any other rank error is raised as it is."""
    calls = []

    def fake_run_ranks(fn, world_size, args, kwargs, parallel, device, timeout_s, method):
        calls.append(method)
        if method == "forkserver":
            raise DistributedTestError("rank 0:\nRuntimeError: CUDA error: initialization error")
        return ["ok"] * world_size

    monkeypatch.delenv(dist_utils.START_ENV, raising=False)
    monkeypatch.setattr(dist_utils, "_forkserver_failed", False)
    monkeypatch.setattr(dist_utils, "skip_unless_ranks", lambda world_size: None)
    monkeypatch.setattr(dist_utils, "_run_ranks", fake_run_ranks)
    assert run_distributed(_read_env, 2, args=("X",), device="cuda") == ["ok", "ok"]
    assert calls == ["forkserver", "spawn"]
    assert run_distributed(_read_env, 2, args=("X",), device="cuda") == ["ok", "ok"]
    assert calls == ["forkserver", "spawn", "spawn"]

    def failing(fn, world_size, args, kwargs, parallel, device, timeout_s, method):
        calls.append(method)
        raise DistributedTestError("rank 1:\nAssertionError: wrong loss")

    monkeypatch.setattr(dist_utils, "_forkserver_failed", False)
    monkeypatch.setattr(dist_utils, "_run_ranks", failing)
    calls.clear()
    with pytest.raises(DistributedTestError, match="wrong loss"):
        run_distributed(_read_env, 2, args=("X",), device="cuda")
    assert calls == ["forkserver"]


def test_fork_server_started_early_only_when_used(monkeypatch):
    from multiprocessing import forkserver

    started = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: started.append(True))
    monkeypatch.setattr(dist_utils, "_forkserver_failed", False)
    monkeypatch.setenv(dist_utils.START_ENV, "spawn")
    dist_utils.start_fork_server()
    assert started == []
    monkeypatch.delenv(dist_utils.START_ENV)
    dist_utils.start_fork_server()
    assert started == [True]


def _rank_ok(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_port_taken_by_another_process_is_retried(monkeypatch):
    """free_port's port can be taken before rank 0 listens on it: the ranks start again."""
    import socket

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    taken = busy.getsockname()[1]
    ports = [taken]
    real_free_port = dist_utils.free_port
    monkeypatch.setattr(dist_utils, "free_port",
                        lambda: ports.pop() if ports else real_free_port())
    try:
        assert run_distributed(_rank_ok, 2, device="cpu") == [2, 2]
        assert ports == []  # the taken port was handed out first
        ports.extend([taken] * 3)  # taken on every attempt: the error is reported, not hidden
        with pytest.raises(DistributedTestError, match="EADDRINUSE"):
            run_distributed(_rank_ok, 2, device="cpu")
    finally:
        busy.close()
