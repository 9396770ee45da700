"""The dense-KL benchmark helpers on CPU: ``bench_compile.kl_only_fn`` times the KL that dense
mode runs (through the triton backend's dispatch, ``MSA_DENSE_KL``), and
``profile_dense_kl.py`` parses its command line (its timings need a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.scripts import load_script

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="triton kernels on CPU need TRITON_INTERPRET=1")


def test_kl_only_goes_through_the_backend_dispatch(monkeypatch):
    from msa_megatron.ops import triton as triton_backend
    from msa_megatron.ops.triton.dense_kl import dense_kl_loss

    bench = load_script("benchmarks/bench_compile.py")
    cfg = bench.DRY
    x = bench.make_inputs(cfg, 40, None, "iid", "cpu", torch.float32)
    calls = []
    real = triton_backend._kl

    def recording(*args):
        calls.append(args[5])  # block_idx: None for dense mode
        return real(*args)

    monkeypatch.setattr(triton_backend, "_kl", recording)
    value, dq_idx, dk_idx = bench.kl_only_fn(x, cfg)()
    assert calls == [None]
    # on CPU the dispatch picks the Triton one-pass kernel: the same numbers
    from msa_megatron.layout import query_layout

    q_pos, q_kbase = query_layout(x["cu"], 40, "cpu")
    _, lse = triton_backend.ops.attention_fwd(x["q"], x["k"], x["v"], None, q_pos, q_kbase,
                                              cfg["block"], cfg["d"] ** -0.5, cfg["hi"])
    want = dense_kl_loss(x["q"], x["k"], lse, x["q_idx"], x["k_idx"], q_pos, q_kbase,
                         cfg["d"] ** -0.5, cfg["di"] ** -0.5, 1.0 / (40 * cfg["hi"]), True)
    torch.testing.assert_close(value, want[0])
    torch.testing.assert_close(dq_idx, want[1])
    torch.testing.assert_close(dk_idx, want[2])


def test_profile_dense_kl_arguments(monkeypatch, tmp_path):
    prof = load_script("benchmarks/profile_dense_kl.py")
    seen = []
    monkeypatch.setattr(prof, "profile", lambda t, b: seen.append((t, b)) or dict(
        tokens=t, budget=b, wall_ms=1.0, kernels={"k": dict(ms_per_call=1.0, count=1)}))
    monkeypatch.setattr(prof.torch.cuda, "get_device_name", lambda: "none")
    out = str(tmp_path / "profile.json")
    monkeypatch.setattr("sys.argv", ["profile_dense_kl.py", out, "--tokens", "64", "128",
                                     "--budgets", "1024"])
    prof.main()
    assert seen == [(64, 1024), (128, 1024)]
    import json

    with open(out) as f:
        assert [r["tokens"] for r in json.load(f)["runs"]] == [64, 128]
