"""A CPU emulation of the few Gluon / Hopper operations the split dense-KL pass A uses, to run
its actual kernel source (``_dense_kl_gluon_kernels.dense_kl_pass_a_split``) in tests.

Each ``@gluon.jit`` function's Python code is re-bound to globals that implement ``gl``,
``mbarrier``, ``tma`` and ``warpgroup_mma`` in torch: a warp-specialised partition is a Python
thread (a warpgroup is one thread: races between warps of one partition are not modelled),
mbarriers keep real phase / arrival / transaction counts (a wait that never completes is
reported as :class:`Deadlock`; an arrival or transaction below zero as :class:`ProtocolError`),
TMA loads land in shared memory when issued, while asynchronous ``wgmma`` products and TMA
stores read their shared-memory operands only when waited for: a slot released or overwritten
before its reader has finished shows up as wrong numbers. Random short sleeps at each
synchronisation vary the interleaving, and each arrival sleeps briefly so that the threads it
releases act first.
"""

from __future__ import annotations

import random
import threading
import time
import types

import torch


class Deadlock(RuntimeError):
    """A partition waited on an mbarrier phase that never completed."""


class ProtocolError(RuntimeError):
    """An mbarrier got more arrivals or transaction bytes than it expected."""


_DTYPES = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32,
           "float16": torch.float16, "bfloat16": torch.bfloat16}


class Val(torch.Tensor):
    """A register tensor: a value, so ``x += y`` rebinds ``x`` (torch would write in place into
    every alias, e.g. the ``zero_s`` a sum started from)."""

    def __iadd__(self, other):
        return torch.Tensor.__add__(self, other)

    def __isub__(self, other):
        return torch.Tensor.__sub__(self, other)

    def __imul__(self, other):
        return torch.Tensor.__mul__(self, other)


def _val(t: torch.Tensor) -> Val:
    return t.as_subclass(Val)


class _Layout:
    def __init__(self, *args, **kwargs):
        self.args = args


class _BarrierLayout(_Layout):
    pass


class Ptr:
    """A pointer: a flat tensor and element offsets (an int or an int tensor)."""

    def __init__(self, base: torch.Tensor, off=0):
        self.base, self.off = base.view(-1), off

    def __add__(self, other):
        return Ptr(self.base, self.off + other)

    __radd__ = __add__


class Desc:
    """A TMA descriptor: a 2-D tensor and the block shape."""

    def __init__(self, t: torch.Tensor, block):
        self.t, self.block = t, list(block)
        self.dtype = t.dtype
        self.layout = _Layout()
        self.block_type = types.SimpleNamespace(nbytes=block[0] * block[1] * t.element_size())


class SMem:
    """Shared memory: a tensor view."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.dtype = t.dtype

    def index(self, i):
        return SMem(self.t[int(i)])

    def slice(self, start, length):
        return SMem(self.t[int(start):int(start) + int(length)])

    def permute(self, order):
        return SMem(self.t.permute(*order))

    def load(self, layout=None):
        return _val(self.t.clone())

    def store(self, value):
        self.t.copy_(value.to(self.t.dtype))

    def _reinterpret(self, dtype, shape, layout):
        return SMem(self.t.reshape(-1).view(dtype).view(*shape))


class Emulator:
    """One emulated launch context (its barriers share a condition variable)."""

    def __init__(self, seed: int = 0, timeout: float = 10.0, jitter: float = 0.3,
                 release_delay: float = 1e-3):
        self.cond = threading.Condition()
        self.timeout, self.jitter, self.release_delay = timeout, jitter, release_delay
        self.rng = random.Random(seed)
        self.local = threading.local()
        self.failed = None
        self.program = (0, 0, 1, 1)

    # --- scheduling noise and per-thread queues ---
    def _noise(self):
        if self.rng.random() < self.jitter:
            time.sleep(self.rng.random() * 2e-4)

    def _queue(self, name):
        q = getattr(self.local, name, None)
        if q is None:
            q = []
            setattr(self.local, name, q)
        return q

    # --- mbarriers ---
    def make_barriers(self, n):
        return _BarArray([_Bar(self) for _ in range(n)])

    def _wait(self, bar, phase):
        self._noise()
        with self.cond:
            ok = self.cond.wait_for(lambda: bar.phase % 2 != int(phase) or self.failed,
                                    timeout=self.timeout)
            if self.failed:
                raise Deadlock(f"another partition failed: {self.failed}")
            if not ok:
                self.failed = "deadlock"
                self.cond.notify_all()
                raise Deadlock(f"{threading.current_thread().name}: mbarrier wait for parity "
                               f"{int(phase)} never completed (phase {bar.phase}, "
                               f"{bar.pending} arrivals and {bar.tx} bytes pending)")

    # --- the gl / mbarrier / tma / wgmma namespaces ---
    def namespaces(self):
        emu = self

        def load(ptr, mask=None, other=0.0):
            off = ptr.off
            if not torch.is_tensor(off):
                return ptr.base[int(off)].item()
            off = off.long()
            if mask is None:
                return _val(ptr.base[off])
            mask = torch.broadcast_to(mask, off.shape)
            v = ptr.base[torch.where(mask, off, 0)]
            return _val(torch.where(mask, v, torch.tensor(other, dtype=v.dtype)))

        def store(ptr, value, mask=None):
            off = ptr.off
            if not torch.is_tensor(off):
                ptr.base[int(off)] = value
                return
            off = off.long()
            value = torch.broadcast_to(torch.as_tensor(value), off.shape)
            if mask is None:
                mask = torch.ones_like(off, dtype=torch.bool)
            mask = torch.broadcast_to(mask, off.shape)
            ptr.base[off[mask]] = value[mask].to(ptr.base.dtype)

        def _num(x):
            return isinstance(x, (int, float))

        def maximum(a, b):
            return max(a, b) if _num(a) and _num(b) else _val(torch.maximum(
                torch.as_tensor(a), torch.as_tensor(b)))

        def minimum(a, b):
            return min(a, b) if _num(a) and _num(b) else _val(torch.minimum(
                torch.as_tensor(a), torch.as_tensor(b)))

        def allocate_shared_memory(dtype, shape, layout, value=None):
            if isinstance(layout, _BarrierLayout):
                return emu.make_barriers(shape[0])
            t = torch.zeros(shape, dtype=dtype)
            if value is not None:
                t.copy_(value.to(dtype))
            return SMem(t)

        def warp_specialize(partitions, warps, regs):
            threads, errors = [], []

            def run(fn, args):
                try:
                    fn(*args)
                    emu._flush_stores(0)
                except BaseException as err:  # noqa: BLE001 - reported to the caller
                    errors.append(err)
                    with emu.cond:
                        emu.failed = emu.failed or repr(err)
                        emu.cond.notify_all()

            for k, (fn, args) in enumerate(partitions):
                th = threading.Thread(target=run, args=(fn, args), name=f"partition{k}",
                                      daemon=True)
                threads.append(th)
                th.start()
            for th in threads:
                th.join(emu.timeout * 4)
            if any(th.is_alive() for th in threads):
                raise Deadlock("a partition never finished")
            if errors:
                raise errors[0]

        gl = types.SimpleNamespace(
            constexpr=lambda x: x, float32=torch.float32, int64=torch.int64,
            int32=torch.int32, float16=torch.float16, bfloat16=torch.bfloat16,
            NVMMADistributedLayout=_Layout, SliceLayout=_Layout, BlockedLayout=_Layout,
            SwizzledSharedLayout=_Layout, NVMMASharedLayout=_Layout,
            arange=lambda a, b, layout=None: _val(torch.arange(a, b)),
            zeros=lambda shape, dtype, layout=None: _val(torch.zeros(shape, dtype=dtype)),
            full=lambda shape, v, dtype, layout=None: _val(torch.full(shape, v, dtype=dtype)),
            load=load, store=store, where=torch.where, maximum=maximum, minimum=minimum,
            sum=lambda x, axis: x.sum(axis), exp2=torch.exp2, exp=torch.exp,
            static_range=range, thread_barrier=emu._noise,
            program_id=lambda a: emu.program[a], num_programs=lambda a: emu.program[2 + a],
            allocate_shared_memory=allocate_shared_memory, warp_specialize=warp_specialize,
        )
        mbarrier = types.SimpleNamespace(
            MBarrierLayout=_BarrierLayout, init=lambda bar, count: bar.init(count),
            expect=lambda bar, nbytes: bar.expect(nbytes),
            arrive=lambda bar, count=1: bar.arrive(count), wait=emu._wait,
        )

        def copy_in(desc, coords, bar, smem):
            emu._noise()
            r, c = (int(x) for x in coords)
            block = torch.zeros(desc.block, dtype=desc.dtype)
            src = desc.t[max(r, 0):r + desc.block[0], max(c, 0):c + desc.block[1]]
            block[:src.shape[0], :src.shape[1]] = src
            smem.t.copy_(block)
            bar.transfer(desc.block_type.nbytes)

        def copy_out(desc, coords, smem):
            r, c = (int(x) for x in coords)

            def done():
                dst = desc.t[r:r + desc.block[0], c:c + desc.block[1]]
                dst.copy_(smem.t[:dst.shape[0], :dst.shape[1]])
            emu._queue("stores").append(done)

        tma = types.SimpleNamespace(async_copy_global_to_shared=copy_in,
                                    async_copy_shared_to_global=copy_out,
                                    store_wait=emu._flush_stores)

        def warpgroup_mma(a, b, acc, use_acc=True, is_async=False):
            emu._noise()
            fut = _Mma(a, b, acc, use_acc)
            if not is_async:
                return fut.value()
            emu._queue("mma").append(fut)
            return fut

        def warpgroup_mma_wait(num_outstanding=0, deps=()):
            q = emu._queue("mma")
            while len(q) > num_outstanding:
                q.pop(0).value()
            return deps[0].value()

        return dict(gl=gl, mbarrier=mbarrier, tma=tma, warpgroup_mma=warpgroup_mma,
                    warpgroup_mma_wait=warpgroup_mma_wait, fence_async_shared=lambda: None)

    def _flush_stores(self, n=0):
        q = self._queue("stores")
        while len(q) > n:
            q.pop(0)()

    def bind(self, module, overrides: dict):
        """The module's ``@gluon.jit`` functions re-bound to the emulated namespaces (plus
        ``overrides``): ``{name: python function}``."""
        from triton.experimental.gluon._runtime import GluonJITFunction

        env = dict(vars(module))
        env.update(self.namespaces())
        for name, obj in vars(module).items():
            if isinstance(obj, GluonJITFunction):
                fn = obj.fn
                env[name] = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__,
                                               fn.__closure__)
        env.update(overrides)
        return env


class _BarArray:
    def __init__(self, bars):
        self.bars = bars

    def index(self, i):
        return self.bars[int(i)]


class _Bar:
    def __init__(self, emu):
        self.emu, self.count, self.pending, self.tx, self.phase = emu, 0, 0, 0, 0

    def init(self, count):
        self.count = self.pending = count

    def _complete(self):
        if self.pending < 0 or self.tx < 0:
            self.emu.failed = "protocol"
            raise ProtocolError(f"mbarrier over-arrived ({self.pending} arrivals, {self.tx} "
                                f"bytes pending)")
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
            self.emu.cond.notify_all()

    def expect(self, nbytes):
        self.emu._noise()
        with self.emu.cond:
            self.tx += nbytes
            self.pending -= 1
            self._complete()

    def arrive(self, count=1):
        self.emu._noise()
        with self.emu.cond:
            self.pending -= count
            self._complete()
        # let the released waiters run first: a slot freed before its reader (a lazy product or
        # store) has read it is then overwritten in time to show
        time.sleep(self.emu.release_delay)

    def transfer(self, nbytes):
        with self.emu.cond:
            self.tx -= nbytes
            self._complete()


class _Mma:
    """An asynchronous product; its shared-memory operands are read when it is waited for."""

    def __init__(self, a, b, acc, use_acc):
        self.a, self.b, self.acc, self.use_acc, self.out = a, b, acc, use_acc, None

    def value(self):
        if self.out is None:
            a = self.a.t if isinstance(self.a, SMem) else self.a
            out = _val(a.float() @ self.b.t.float())
            if self.use_acc:
                acc = self.acc.value() if isinstance(self.acc, _Mma) else self.acc
                out = out + acc
            self.out = out
        return self.out


def ftz(x: torch.Tensor) -> torch.Tensor:
    """Subnormal fp32 values flushed to zero (``.ftz``)."""
    return torch.where(x.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(x), x)


MATH_OVERRIDES = {
    "_log2_ftz": lambda x: ftz(torch.log2(ftz(x))),
    "_exp2_ftz": lambda x: ftz(torch.exp2(ftz(x))),
    "_log2_approx": torch.log2,
}
