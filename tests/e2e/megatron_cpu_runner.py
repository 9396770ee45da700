"""Run a ``megatron.training`` script on CPU processes (gloo), for tests only.

``megatron.training`` assumes CUDA throughout (``device='cuda'`` tensors, ``torch.cuda.*``
calls, CUDA RNG trackers). This runner stands in for CUDA so that the Megatron-LM launch kit
(argument defaults, model build, optimizer and scheduler, data loading, save / resume,
dense -> MSA conversion) is exercised end to end on a CPU-only machine before any GPU run:

- every ``device=`` argument and ``Tensor.cuda`` / ``Tensor.to`` naming CUDA is redirected to
  the CPU (a ``TorchFunctionMode``);
- the ``torch.cuda`` functions megatron calls (device count, current device, synchronize,
  memory statistics, RNG state, streams, events) get CPU stand-ins;
- megatron-core's CUDA RNG state setter becomes a no-op, and process groups use gloo.

Usage (the script's own arguments follow it; add ``--distributed-backend gloo``)::

    torchrun --nproc-per-node 2 tests/e2e/megatron_cpu_runner.py \\
        examples/megatron_lm/pretrain_msa_gpt.py --distributed-backend gloo ...

The numbers it produces are CPU numbers; what it proves is that the code paths run.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Redirects CUDA placements to the CPU."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts e.g. param.type() == "torch.cuda.FloatTensor"
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        kwargs.pop("pin_memory", None) if func is not torch.Tensor.pin_memory else None
        if "non_blocking" in kwargs and func is torch.Tensor.to:
            kwargs["non_blocking"] = False
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *args, **kwargs):
        import time

        self._time = time
        self._t = None

    def record(self, *args, **kwargs):
        self._t = self._time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 1000.0 * ((other._t or 0.0) - (self._t or 0.0))


class _Stream:
    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Props:
    name = "fake-cuda (CPU)"
    total_memory = 64 * 2**30
    major, minor = 9, 0
    multi_processor_count = 1
    uuid = "fake"


def _install_fake_cuda() -> None:
    cuda = torch.cuda

    class _Fresh:  # a new function object per attribute (torch._dynamo rejects shared ones)
        def __getattr__(self, value):
            return lambda *a, **k: {"zero": 0, "none": None}[value]

    fresh = _Fresh()
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = fresh.none
    cuda.synchronize = fresh.none
    cuda.empty_cache = fresh.none
    cuda.init = fresh.none
    cuda._lazy_init = fresh.none
    cuda.is_initialized = lambda: True
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, name, fresh.zero)
    cuda.reset_peak_memory_stats = fresh.none
    cuda.reset_max_memory_allocated = fresh.none
    cuda.memory_stats = lambda *a, **k: {}
    cuda.mem_get_info = lambda *a, **k: (32 * 2**30, 64 * 2**30)
    cuda.get_device_properties = lambda *a, **k: _Props()
    cuda.get_device_name = lambda *a, **k: _Props.name
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.is_bf16_supported = lambda *a, **k: True
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = fresh.none
    cuda.manual_seed = fresh.none
    cuda.manual_seed_all = fresh.none
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = fresh.none
    cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    cuda.set_rng_state_all = fresh.none
    cuda.device = lambda *a, **k: contextlib.nullcontext()
    nvtx = types.SimpleNamespace(range_push=fresh.none, range_pop=fresh.none, mark=fresh.none,
                                 range=lambda *a, **k: contextlib.nullcontext())
    cuda.nvtx = nvtx
    sys.modules["torch.cuda.nvtx"] = nvtx  # type: ignore[assignment]

    init_pg = torch.distributed.init_process_group

    def init_process_group(*args, **kwargs):
        kwargs.pop("device_id", None)
        kwargs["backend"] = "gloo"
        return init_pg(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mc_random

    mc_random._set_cuda_rng_state = lambda *a, **k: None
    mc_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.random.set_rng_state = lambda *a, **k: None


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # no inductor compiles of the jit fusions on CPU
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _install_fake_cuda()
    _CudaToCpu().__enter__()
    _patch_megatron()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
