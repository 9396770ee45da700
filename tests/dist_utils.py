"""Run a function on N real ranks for distributed tests (gloo on CPU, NCCL on CUDA).

Usage::

    from tests.dist_utils import run_distributed

    def _worker(rank, world_size, n):          # module-level, so it pickles
        ...
        return {"out": tensor}                 # anything torch.save can write

    results = run_distributed(_worker, 2, args=(4,), tp=2)   # list indexed by rank

Each rank is a fresh process (forked on CPU; on CUDA forked from a fork server that imported
torch, megatron-core and msa_megatron once, without touching CUDA) that joins a process group on a
free local port, optionally initialises megatron-core's model-parallel groups
(``parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)``), runs the
function and sends back its return value (moved to CPU). A failing rank raises
:class:`DistributedTestError` in the caller with that rank's traceback.

Import heavy modules (megatron-core) at the top of the test module: forked ranks inherit them,
while importing megatron-core in each rank costs seconds.

Device switch: ``MSA_TEST_DEVICE=cuda`` (or ``run_distributed(..., device="cuda")``) runs NCCL
with one GPU per rank; the default is CPU with gloo. ``MSA_TEST_START=fork|forkserver|spawn``
overrides how the ranks start (default: fork on CPU, forkserver on CUDA; a fork server whose
children cannot initialise CUDA is replaced by spawn for the rest of the session). On CPU, megatron-core's CUDA RNG tracker is
replaced by a CPU stand-in (:func:`install_megatron_cpu_shims`): test-only, never product code.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEVICE_ENV = "MSA_TEST_DEVICE"
START_ENV = "MSA_TEST_START"
START_METHODS = ("fork", "forkserver", "spawn")
# Imported once by the fork server (CUDA runs): what every rank would otherwise import anew.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "triton", "megatron.core",
                      "megatron.core.models.gpt", "msa_megatron", "msa_megatron.megatron",
                      "tests.dist_utils", "tests.support.gpt_harness"]
# What a rank forked from a process that had initialised CUDA reports.
_CUDA_FORK_ERRORS = ("Cannot re-initialize CUDA in forked subprocess", "initialization error")
_forkserver_failed = False
DEFAULT_TIMEOUT_S = 180
FAILURE_GRACE_S = 5.0
POLL_S = 0.05


class DistributedTestError(RuntimeError):
    """A rank of :func:`run_distributed` raised; the message holds its traceback."""


def selected_device() -> str:
    """``"cuda"`` when ``MSA_TEST_DEVICE=cuda`` is set, else ``"cpu"``."""
    return "cuda" if os.environ.get(DEVICE_ENV, "cpu").lower() == "cuda" else "cpu"


def skip_unless_ranks(world_size: int) -> None:
    """``pytest.skip`` when the selected device cannot host ``world_size`` ranks (CUDA runs need
    one GPU per rank; CPU runs always can)."""
    if selected_device() == "cuda" and torch.cuda.device_count() < world_size:
        import pytest

        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_megatron_cpu_shims() -> None:
    """Let megatron-core's RNG tracker, checkpointing and RoPE run without CUDA (tests only).

    megatron-core keeps per-parallel-region CUDA RNG states; on CPU there is one generator, so the
    tracker's ``add`` only records the seed, ``fork`` is a plain context and the "CUDA" state saved
    around recomputation is the CPU state (dropout-free tests are unaffected by the difference);
    RoPE frequencies stay on the CPU instead of moving to ``torch.cuda.current_device()``;
    ``torch.cuda.synchronize`` (called by distributed checkpointing) does nothing.
    """
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        return

    class _CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = seed

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            yield

    mrandom.CudaRNGStatesTracker = _CPURNGStatesTracker
    original_get_emb = rotary_pos_embedding.RotaryEmbedding.get_emb

    def get_emb_on_cpu(self, *args, **kwargs):
        # megatron moves the RoPE frequencies to torch.cuda.current_device() on first use.
        real_current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: self.inv_freq.device
        try:
            return original_get_emb(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = real_current_device

    rotary_pos_embedding.RotaryEmbedding.get_emb = get_emb_on_cpu
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.synchronize = lambda *args, **kwargs: None  # dist_checkpointing's save calls it


@contextlib.contextmanager
def cuda_device_as_cpu():
    """On a machine without CUDA, let code that allocates on ``torch.cuda.current_device()``
    (megatron-core's distributed checkpointing) allocate on the CPU inside this block (tests
    only). Does nothing when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    real_current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = real_current_device


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def start_method(device: str) -> str:
    """How :func:`run_distributed` starts ranks on ``device``: ``$MSA_TEST_START`` when set, else
    ``"fork"`` on CPU (ranks inherit the imported modules) and ``"forkserver"`` on CUDA (CUDA
    cannot be used in a child forked after the parent initialised it; the fork server never
    does, and its preloaded imports save every rank seconds), ``"spawn"`` once a fork server
    failed to start CUDA ranks in this session.

    Raises:
        ValueError: ``$MSA_TEST_START`` is not one of fork, forkserver, spawn, or is fork with
            ``device="cuda"``.
    """
    method = os.environ.get(START_ENV, "").strip().lower()
    if method and method not in START_METHODS:
        raise ValueError(f"{START_ENV} must be one of {START_METHODS}, got {method!r}")
    if device == "cuda" and method == "fork":
        raise ValueError(f"{START_ENV}=fork cannot run CUDA ranks (CUDA is not fork-safe)")
    if not method:
        method = "fork" if device == "cpu" else "forkserver"
    if method == "forkserver" and _forkserver_failed:
        method = "spawn"
    return method


def _context(method: str):
    ctx = mp.get_context(method)
    if method == "forkserver":
        # NVML instead of the CUDA driver for torch.cuda.is_available / device_count, so that
        # no import in the fork server initialises CUDA (its children could not use it then).
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server of CUDA runs now, in the background (its preload imports then
    overlap pytest's collection); does nothing unless CUDA ranks would start from it."""
    if start_method("cuda") != "forkserver":
        return
    from multiprocessing import forkserver

    _context("forkserver")
    forkserver.ensure_running()


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable, args: Sequence, kwargs: dict,
    parallel: Optional[dict], device: str, result_dir: str, timeout_s: int,
    environ: Optional[dict] = None,
) -> None:
    result_path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        if environ is not None:  # a fork server's children start with its (older) environment
            os.environ.clear()
            os.environ.update(environ)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        os.environ[DEVICE_ENV] = device
        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        if parallel is not None:
            from megatron.core import parallel_state

            if device == "cpu":
                install_megatron_cpu_shims()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=parallel["tp"],
                pipeline_model_parallel_size=parallel["pp"],
                context_parallel_size=parallel["cp"],
            )
        value = fn(rank, world_size, *args, **kwargs)
        payload = {"ok": True, "value": _to_cpu(value)}
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        payload = {"ok": False, "error": f"rank {rank}:\n{traceback.format_exc()}"}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with open(result_path + ".tmp", "wb") as f:
        f.write(buffer.getvalue())
    os.replace(result_path + ".tmp", result_path)  # atomic: the parent polls for this file
    if parallel is not None and payload["ok"]:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _failed_rank_reported(result_dir: str, world_size: int) -> bool:
    for rank in range(world_size):
        path = os.path.join(result_dir, f"rank{rank}.pt")
        if os.path.exists(path) and not torch.load(path, weights_only=False)["ok"]:
            return True
    return False


def _wait(procs: list, result_dir: str, timeout_s: int) -> None:
    """Join all ranks; once one has failed, give the others a short grace and kill them
    (they would otherwise wait in a collective until the process-group timeout)."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed_at is None and _failed_rank_reported(result_dir, len(procs)):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            break
        time.sleep(POLL_S)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence = (),
    kwargs: Optional[dict] = None,
    tp: Optional[int] = None,
    pp: int = 1,
    cp: int = 1,
    device: Optional[str] = None,
    timeout_s: int = DEFAULT_TIMEOUT_S,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return the results.

    Args:
        fn: a module-level function (picklable: CUDA ranks start from a fork server or by
            spawn, :func:`start_method`). Its return value
            is moved to CPU and must be writable by ``torch.save``.
        world_size: number of ranks (processes).
        args, kwargs: extra arguments for ``fn`` (picklable).
        tp, pp, cp: when ``tp`` is given, megatron-core's model-parallel groups are initialised
            with these sizes (data parallel takes the rest); ``None`` leaves megatron alone.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank); default from the
            ``MSA_TEST_DEVICE`` environment variable, else CPU.
        timeout_s: collective timeout of the process group, and the join timeout per rank.

    Returns:
        ``[result_of_rank_0, ..., result_of_rank_{N-1}]``.

    Raises:
        DistributedTestError: a rank raised (message: its traceback) or died without a result.
        ValueError: a bad ``$MSA_TEST_START`` (:func:`start_method`).
        pytest's Skipped: a CUDA run with fewer GPUs than ranks.
    """
    global _forkserver_failed
    device = device or selected_device()
    if device == "cuda":
        skip_unless_ranks(world_size)
    parallel = None if tp is None else {"tp": tp, "pp": pp, "cp": cp}
    method = start_method(device)
    try:
        return _run_ranks_on_free_port(fn, world_size, args, kwargs, parallel, device,
                                       timeout_s, method)
    except DistributedTestError as error:
        if method != "forkserver" or device != "cuda" \
                or not any(text in str(error) for text in _CUDA_FORK_ERRORS):
            raise
    # The fork server had initialised CUDA (an import did): spawn from now on.
    _forkserver_failed = True
    return _run_ranks_on_free_port(fn, world_size, args, kwargs, parallel, device, timeout_s,
                                   "spawn")


def _run_ranks_on_free_port(*args: Any, attempts: int = 3) -> List[Any]:
    """:func:`_run_ranks`, again on a fresh port when another process took the chosen one.

    :func:`free_port` can only say that a port was free a moment ago; test processes running side
    by side (``benchmarks/gpu_tests.py``) sometimes take it before rank 0 listens on it.
    """
    for attempt in range(attempts):
        try:
            return _run_ranks(*args)
        except DistributedTestError as error:
            if "EADDRINUSE" not in str(error) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _run_ranks(fn: Callable, world_size: int, args: Sequence, kwargs: Optional[dict],
               parallel: Optional[dict], device: str, timeout_s: int, method: str) -> List[Any]:
    """Start ``world_size`` ranks with ``method``, wait for them, return their results."""
    ctx = _context(method)
    environ = None if method == "fork" else dict(os.environ)
    port = free_port()  # taken meanwhile by another process: _run_ranks_on_free_port retries
    with tempfile.TemporaryDirectory(prefix="msa_dist_") as result_dir:
        procs = [
            ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, tuple(args),
                                                 dict(kwargs or {}), parallel, device,
                                                 result_dir, timeout_s, environ))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        _wait(procs, result_dir, timeout_s)
        errors, results = [], []
        for rank, p in enumerate(procs):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: exited with code {p.exitcode} and no result")
                results.append(None)
                continue
            payload = torch.load(path, weights_only=False)
            if payload["ok"]:
                results.append(payload["value"])
            else:
                errors.append(payload["error"])
                results.append(None)
    if errors:
        raise DistributedTestError("\n".join(errors))
    return results
