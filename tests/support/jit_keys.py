"""The Triton kernel variants a piece of code makes the GPU's JIT compile, counted on any machine.

Triton compiles one variant per distinct cache key of a kernel: its constexprs, launch options
(``num_warps``, ``num_stages``) and, per other argument, the type and the *specialisation* the
JIT derives from the value (a tensor's 16-byte alignment; an int equal to 1 or divisible by 16,
unless the kernel marks it ``do_not_specialize``). :class:`JitKeys` computes that key for every
launch with Triton's own binder (``triton.runtime.jit.create_function_from_signature`` with an
sm_90 CUDA backend; the same call ``JITFunction.run`` makes, present in Triton 3.6 and 3.9), so
a CPU run under ``TRITON_INTERPRET=1`` counts what an H200 would compile, and a GPU run counts
the same keys without reading Triton's caches.

``execute=False`` (interpreter only) records the launches without running them: the host code
of the Triton backend chooses every launch from the shapes alone (no host synchronisation), so
the keys of a paper-size step (64 heads, 128K tokens) are counted in seconds; outputs are then
meaningless.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Dict, Iterator


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class JitKeys:
    """Distinct JIT cache keys per kernel name, collected while :meth:`watch` is open.

    Attributes:
        keys: ``{kernel name: set of keys}``; a key is ``(specialisation, options)``.
        launches: ``{kernel name: launch count}``.
    """

    def __init__(self) -> None:
        self.keys: Dict[str, set] = collections.defaultdict(set)
        self.launches: collections.Counter = collections.Counter()
        self._binders: dict = {}

    def _binder(self, kernel):
        """Triton's argument binder of ``kernel`` (a ``JITFunction``, or the interpreter's
        ``InterpretedFunction``: a ``JITFunction`` of the same source and options is built)."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        hit = self._binders.get(id(kernel))
        if hit is not None and hit[0] is kernel:
            return hit[1]
        jit = kernel
        if not isinstance(kernel, JITFunction):
            options = getattr(kernel, "kwargs", {})
            jit = JITFunction(kernel.fn, **{k: options.get(k) for k in (
                "do_not_specialize", "do_not_specialize_on_alignment")})
        binder = create_function_from_signature(jit.signature, jit.params,
                                                make_backend(GPUTarget("cuda", 90, 32)))
        self._binders[id(kernel)] = (kernel, binder)
        return binder

    @contextlib.contextmanager
    def watch(self, execute: bool = True) -> Iterator["JitKeys"]:
        """Record the keys of every Triton launch inside the block (``execute=False``: the
        interpreter's launches are recorded but not run).

        Raises:
            ValueError: ``execute=False`` outside the interpreter.
        """
        if interpreting():
            from triton.runtime.interpreter import InterpretedFunction as cls
        else:
            if not execute:
                raise ValueError("execute=False needs TRITON_INTERPRET=1")
            from triton.runtime.jit import JITFunction as cls
        original = cls.run
        watch = self

        def run(kernel, *args, grid, warmup, **kwargs):
            _, specialisation, options = watch._binder(kernel)(*args, **kwargs)
            name = kernel.fn.__name__
            watch.keys[name].add((repr(specialisation), repr(sorted(options.items()))))
            watch.launches[name] += 1
            if not execute:
                return None
            return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        cls.run = run
        try:
            yield self
        finally:
            cls.run = original

    def snapshot(self) -> Dict[str, frozenset]:
        """The keys so far, per kernel (for :meth:`added`)."""
        return {name: frozenset(keys) for name, keys in self.keys.items()}

    def added(self, snapshot: Dict[str, frozenset]) -> Dict[str, int]:
        """``{kernel name: keys new since snapshot}``, kernels with none left out."""
        out = {}
        for name, keys in self.keys.items():
            new = len(keys - snapshot.get(name, frozenset()))
            if new:
                out[name] = new
        return out

    def counts(self) -> Dict[str, int]:
        """``{kernel name: distinct keys}``."""
        return {name: len(keys) for name, keys in sorted(self.keys.items())}

    def total(self) -> int:
        return sum(len(keys) for keys in self.keys.values())
