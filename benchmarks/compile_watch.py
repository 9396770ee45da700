"""Triton kernels compiled while a benchmark runs, and the seconds spent compiling them.

Shared by ``bench_cp.py`` (per phase and row) and ``first_step_compiles.py`` (per step).
"""

from __future__ import annotations

import collections
import importlib.util
import os
import sys
import time
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.support


class CompileWatch:
    """Triton kernels compiled so far in this process, and the seconds spent compiling them.

    On the GPU: Triton's JIT hooks (``knobs.runtime.jit_cache_hook`` before a compile,
    ``jit_post_compile_hook`` after; a load from Triton's on-disk cache counts as a compile,
    a fast one). Under ``TRITON_INTERPRET=1`` nothing compiles; counted instead are the distinct
    JIT keys the GPU would compile, from Triton's own argument binder
    (:class:`tests.support.jit_keys.JitKeys`), so a CPU dry run shows which phase would compile
    what. ``seconds`` stays 0 there.
    """

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.names: collections.Counter = collections.Counter()
        self.mode = "none"
        self._started: Dict[object, float] = {}
        self._keys = None  # the interpreter's JIT keys (JitKeys), when interpreting
        if importlib.util.find_spec("triton") is None:
            return
        if os.environ.get("TRITON_INTERPRET") == "1":
            self._watch_interpreter()
        else:
            self._watch_jit()

    def _watch_jit(self) -> None:
        try:
            from triton import knobs
            runtime = knobs.runtime
            before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        except (ImportError, AttributeError):
            return

        def on_start(**kw):
            self._started[repr(kw.get("key"))] = time.perf_counter()
            return before(**kw) if before else None  # a truthy value would skip the compile

        def on_done(**kw):
            start = self._started.pop(repr(kw.get("key")), None)
            self.count += 1
            self.names[str(getattr(kw.get("fn"), "name", "?")).rsplit(".", 1)[-1]] += 1
            if start is not None:
                self.seconds += time.perf_counter() - start
            return after(**kw) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_done
        self.mode = "triton jit hooks"

    def _watch_interpreter(self) -> None:
        try:  # Triton's own binder keys every launch (tests/support/jit_keys.py)
            from tests.support.jit_keys import JitKeys
        except ImportError:
            return
        self._keys = JitKeys()
        self._watching = self._keys.watch()  # kept: a collected context would end the watch
        self._watching.__enter__()  # left open: the whole run is watched
        self.mode = "interpreter: specialisations a GPU would compile"

    def _refresh(self) -> None:
        if self._keys is not None:
            self.count = self._keys.total()
            self.names = collections.Counter(self._keys.counts())

    def snapshot(self):
        self._refresh()
        return self.count, self.seconds, collections.Counter(self.names)

    def since(self, snap) -> dict:
        self._refresh()
        count, seconds, names = snap
        return {"compiles": self.count - count, "compile_s": round(self.seconds - seconds, 2),
                "kernels": dict(self.names - names)}
