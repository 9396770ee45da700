"""benchmarks/gluon_probe.py: the float64 reference against a direct sum, the plain Triton
kernel against the reference under the interpreter, argument checks, the log / SASS parsers,
and the ``compile`` subcommand for sm_90 with the GPU machine's Triton (3.6, at /tmp/t36site;
skipped without it). The Gluon kernel itself only runs on an sm_90 GPU."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.support.scripts import REPO, load_script

T36 = "/tmp/t36site"


@pytest.fixture(scope="module")
def probe():
    return load_script("benchmarks/gluon_probe.py")


def _inputs(probe, tokens, heads, index_heads, dtype, dim=32, index_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, index_heads, dim, generator=gen).to(dtype)
    k_idx = torch.randn(tokens, index_dim, generator=gen).to(dtype)
    return q, k, probe.causal_lse(q, k), k_idx


def test_reference_is_the_direct_sum(probe):
    q, k, lse, k_idx = _inputs(probe, 7, 4, 2, torch.float64, dim=16, index_dim=8)
    out = probe.teacher_rows_torch(q, k, lse, k_idx, 2, chunk=3)
    want = torch.zeros(7, 2, 8, dtype=torch.float64)
    for t in range(7):
        for i in range(2):
            for s in range(t + 1):
                w = sum(math.exp(16 ** -0.5 * float(q[t, h] @ k[s, i]) - float(lse[t, h]))
                        for h in (2 * i, 2 * i + 1)) / 2
                want[t, i] += w * k_idx[s]
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_causal_lse_normalises_each_head(probe):
    q, k, lse, _ = _inputs(probe, 9, 4, 2, torch.float64)
    s = torch.einsum("thd,shd->ths", q, k.repeat_interleave(2, dim=1)) * 32 ** -0.5
    s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1)[:, None, :], -math.inf)
    torch.testing.assert_close(torch.exp(s - lse[:, :, None]).sum(-1),  # lse: fp32 math
                               torch.ones(9, 4, dtype=torch.float64), rtol=0, atol=2e-6)


@pytest.mark.parametrize("tokens,heads,index_heads,block_m,block_n,dtype", [
    (1, 16, 1, 16, 16, torch.float32),
    (100, 16, 1, 64, 16, torch.float32),
    (300, 32, 2, 64, 64, torch.float16),
    (300, 2, 2, 16, 64, torch.float32),  # G = 1
    (100, 3, 3, 16, 16, torch.float16),  # G = 1, odd head count
])
def test_triton_matches_reference(probe, tokens, heads, index_heads, block_m, block_n, dtype):
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (CPU) or a GPU")
    q, k, lse, k_idx = _inputs(probe, tokens, heads, index_heads, dtype)
    out = probe.teacher_rows_triton(q, k, lse, k_idx, index_heads, block_m=block_m,
                                    block_n=block_n, num_warps=4)
    ref = probe.teacher_rows_torch(q, k, lse, k_idx, index_heads)
    err = probe.errors(out, ref)
    # fp16 rounds p to 11 bits before the k_idx product
    assert err["rel_norm"] < (3e-3 if dtype == torch.float16 else 1e-5), err


@pytest.mark.parametrize("change,error,word", [
    ({"k": torch.zeros(8, 3, 32)}, ValueError, "key head"),
    ({"lse": torch.zeros(8, 3)}, ValueError, "lse"),
    ({"k_idx": torch.zeros(7, 16)}, ValueError, "k_idx"),
    ({"index_heads": 3}, ValueError, "index_heads"),
    ({"k_idx": torch.zeros(8, 16, dtype=torch.float16)}, TypeError, "dtype"),
])
def test_bad_arguments_are_named(probe, change, error, word):
    args = dict(q=torch.zeros(8, 4, 32), k=torch.zeros(8, 2, 32), lse=torch.zeros(8, 4),
                k_idx=torch.zeros(8, 16), index_heads=2)
    args.update(change)
    with pytest.raises(error, match=word):
        probe.teacher_rows_torch(**args)


def test_triton_tiles_are_checked(probe):
    q, k, lse, k_idx = _inputs(probe, 4, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="block_n"):
        probe.teacher_rows_triton(q, k, lse, k_idx, 2, block_n=48)


def test_gluon_arguments_are_checked(probe):
    q, k, lse, k_idx = _inputs(probe, 4, 2, 2, torch.float32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        probe.teacher_rows_gluon(q, k, lse, k_idx, 2)
    q, k, k_idx = q.half(), k.half(), k_idx.half()
    with pytest.raises(ValueError, match="block_m must be 16 num_warps"):
        probe.teacher_rows_gluon(q, k, lse, k_idx, 2, block_m=64)
    with pytest.raises(ValueError, match="unknown tiles"):
        probe.teacher_rows_gluon(q, k, lse, k_idx, 2, stages=3)
    with pytest.raises(ValueError, match="block_m must be 32 num_warps = 128"):
        probe.teacher_rows_gluon(q, k, lse, k_idx, 2, ping_pong=True, block_m=64, num_warps=4)


def test_flops_counts_both_products(probe):
    assert probe.flops(2, heads=64, index_heads=4, dim=128, index_dim=128) == \
        2 * (2 * 64 * 128 + 2 * 4 * 128)


def test_ptxas_and_sass_parsers(probe):
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "    24 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 2 barriers\n")
    assert probe.ptxas_resources(log) == {"registers": 255, "spill_stores": 40,
                                          "spill_loads": 36}
    sass = ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;\n"
            "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;\n"
            "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\nWARPGROUP.ARRIVE ;\nMUFU.EX2 R3, R4 ;\n")
    counts = probe.sass_counts(sass)
    assert counts["HGMMA"] == 2 and counts["WARPGROUP.DEPBAR"] == 1
    assert counts["WARPGROUP.ARRIVE"] == 1 and counts["MUFU.EX2"] == 1 and counts["SYNCS"] == 0


def test_serialisation_warnings_are_found(probe):
    log = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to non wgmma instructions defining accumulator registers\n"
           "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to non wgmma instructions reading accumulator registers\n")
    assert probe.serialized(log) == "C7514,C7515"
    assert probe.serialized("ptxas info    : Used 168 registers, used 2 barriers\n") == ""


def test_cli_without_gpu_says_so(probe, tmp_path, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main([str(tmp_path / "x.json")]) == 2


@pytest.mark.skipif(not os.path.isdir(os.path.join(T36, "triton")),
                    reason="needs Triton 3.6 at /tmp/t36site (pip install --target "
                           "/tmp/t36site triton==3.6.0), the GPU machine's version")
def test_compile_subcommand_for_sm90():
    """Both kernels compile for sm_90 with Triton 3.6 (~20 s on CPU); the Gluon products are
    asynchronous wgmma that ptxas did not serialise, one consumer wait per head."""
    env = dict(os.environ, PYTHONPATH=f"{T36}:{REPO}")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "benchmarks/gluon_probe.py", "compile"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert set(lines) == {"triton", "gluon", "gluon_wg1", "gluon_bn128", "gluon_pp",
                          "gluon_bn128_q2", "gluon_bn128_k1q6", "kl", "kl_g4", "kl_g1", "kls",
                          "kls_g4", "kls_g1"}, done.stdout
    # the dense KL's pass A, fused and split (teacher and epilogue warpgroups)
    for name, heads in (("kl", 16), ("kl_g4", 4), ("kl_g1", 1), ("kls", 16), ("kls_g4", 4),
                        ("kls_g1", 1)):
        assert "wgmma serialised no " in lines[name], lines[name]
        # per key step one wait per head, the student product and dz k_idx
        assert f"WARPGROUP.DEPBAR {heads + 2} " in lines[name], lines[name]
    for name in ("gluon", "gluon_wg1", "gluon_bn128", "gluon_pp", "gluon_bn128_q2",
                 "gluon_bn128_k1q6"):
        consumers = 2 if name == "gluon_pp" else 1  # partitions with their own code
        assert "wgmma serialised no " in lines[name], lines[name]
        # per key step 16 heads + k_idx: 17 waits per consumer's code
        assert f"WARPGROUP.DEPBAR {17 * consumers} " in lines[name], lines[name]
        hgmma = int(lines[name].split("HGMMA ")[1].split()[0])
        assert hgmma >= 16 * 8 * consumers, lines[name]  # 8 k-steps per head's product
        assert "USETMAXREG 0 " not in lines[name] and "UTMALDG 0 " not in lines[name]
    assert "spill 0/0" in lines["triton"], lines["triton"]
    for line in lines.values():  # sass_check.py: the ptxas 12.8 bug seen in session 10
        assert "uninit UR none " in line, line


def test_gpu_run_records_failures_and_hangs(probe, tmp_path, monkeypatch):
    """Each implementation runs in a child process: a result, a failure (exit status 1 with
    the child's error) and a hang (time limit) all end up in the JSON, in IMPLS order; the
    Gluon ones after a hang are skipped."""
    calls = []

    def run(command, capture_output, text, timeout):
        name, part = command[3], command[4]
        calls.append(name)
        if name == "gluon_wg1":
            raise subprocess.TimeoutExpired(command, timeout, output=b"gluon_wg1 check\n")
        entry = {"times": {"4096": {"ms": 2.0}}} if name == "triton" else \
            {"times": {}, "error": "CompilationError: boom"}
        with open(part, "w") as f:
            json.dump(entry, f)
        return subprocess.CompletedProcess(command, 0 if name == "triton" else 1,
                                           stdout=f"{name} line\n", stderr="trace")

    monkeypatch.setattr(probe.subprocess, "run", run)
    monkeypatch.setattr(probe.torch.cuda, "get_device_name", lambda device: "fake H200")
    out = tmp_path / "probe.json"
    assert probe.run_gpu(str(out), [4096], ["gluon_bn128", "gluon_wg1", "gluon", "triton"],
                         timeout=5) == 0  # asked out of order; gluon_pp not asked
    assert calls == ["triton", "gluon", "gluon_wg1"]
    result = json.loads(out.read_text())
    assert result["gpu"] == "fake H200" and result["tokens"] == [4096]
    impls = result["impls"]
    assert impls["triton"] == {"times": {"4096": {"ms": 2.0}}}
    assert impls["gluon"]["error"] == "CompilationError: boom" and impls["gluon"]["stderr"]
    assert "timed out after 5" in impls["gluon_wg1"]["error"]
    assert impls["gluon_wg1"]["stdout"] == "gluon_wg1 check\n"
    assert impls["gluon_bn128"] == {"error": "skipped: gluon_wg1 hung"}


def test_child_writes_its_error(probe, tmp_path, monkeypatch):
    def fail(name, tokens):
        error = RuntimeError("CUDA error: an illegal memory access")
        error.entry = {"tiles": {"block_m": 128}, "times": {}, "errors": {"max_abs": 0.0}}
        raise error

    monkeypatch.setattr(probe, "run_impl", fail)
    path = tmp_path / "part.json"
    assert probe.run_child("gluon", str(path), [4096]) == 1
    entry = json.loads(path.read_text())
    assert entry["tiles"] == {"block_m": 128} and entry["errors"] == {"max_abs": 0.0}
    assert entry["error"].startswith("RuntimeError: CUDA error") and "Traceback" in \
        entry["traceback"]


def test_run_impl_checks_then_times(probe, monkeypatch):
    """run_impl's path on CPU: the Triton kernel (interpreter) against the reference at the
    check length, then one time per token count, TFLOP/s from ``flops``."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    small = functools.partial(_inputs, probe, heads=4, index_heads=1, dtype=torch.float32)
    monkeypatch.setattr(probe, "paper_inputs", lambda tokens, device: small(tokens))
    monkeypatch.setattr(probe, "INDEX_HEADS", 1)
    monkeypatch.setattr(probe, "CHECK_TOKENS", 40)
    monkeypatch.setattr(probe.torch.cuda, "synchronize", lambda: None)
    timed = []
    monkeypatch.setattr(probe, "time_ms", lambda fn: (timed.append(fn().shape), 4.0)[1])
    entry = probe.run_impl("triton", [40, 70])
    assert entry["errors"]["rel_norm"] < 1e-5, entry
    assert timed == [(40, 1, 16), (70, 1, 16)]
    assert entry["times"]["70"] == {"ms": 4.0, "tflops": probe.flops(70) / 4.0 / 1e9}


def _brute_lse(q, k, q_pos, q_kbase):
    """``[Tq, Hq]`` float64 LSE of each query row against its keys, one row at a time."""
    hq, dim = q.shape[1], q.shape[2]
    kk = k.double().repeat_interleave(hq // k.shape[1], dim=1)
    out = torch.empty(q.shape[:2], dtype=torch.float64)
    for t in range(q.shape[0]):
        lo, last = int(q_kbase[t]), int(q_kbase[t] + q_pos[t])
        s = torch.einsum("hd,uhd->hu", q[t].double(), kk[lo:last + 1]) * dim ** -0.5
        out[t] = torch.logsumexp(s, dim=1)
    return out


@pytest.mark.parametrize("lens,cp", [([64], (2, 0)), ([64], (2, 1)), ([24, 8, 0, 32], (4, 2))])
def test_kl_inputs_cp_view_is_a_rank_of_the_whole_problem(probe, lens, cp):
    """``_kl_inputs(cp=(size, rank))``: the rank's rows (megatron-core's load-balanced split,
    build_cp_layout) of the same problem as ``cp=None``, all keys, and each row's LSE against
    its own keys (its global position and document start)."""
    from msa_megatron.parallel.cp_layout import build_cp_layout

    heads, dim = (8, 2, 2, 1), 16
    whole = probe._kl_inputs(lens, heads, torch.float32, torch.device("cpu"), dim=dim)
    view = probe._kl_inputs(lens, heads, torch.float32, torch.device("cpu"), dim=dim, cp=cp)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = build_cp_layout(cu, cp[0], cp[1], 1, torch.device("cpu")).local_rows
    assert view[0].shape[0] * cp[0] == sum(lens) == view[1].shape[0]
    q, k, lse, q_idx, k_idx, q_pos, q_kbase = view
    for got, want in ((q, whole[0][rows]), (k, whole[1]), (lse, whole[2][rows]),
                      (q_idx, whole[3][rows]), (k_idx, whole[4]), (q_pos, whole[5][rows]),
                      (q_kbase, whole[6][rows])):
        assert torch.equal(got, want)
    torch.testing.assert_close(lse.double(), _brute_lse(q, k, q_pos, q_kbase), rtol=1e-5,
                               atol=1e-5)


def test_kl_checks_cp_are_cp_ranks_of_padded_documents(probe):
    """Every KL_CHECKS_CP case is a valid rank of megatron-core's CP layout (lengths multiples
    of 2 CP), at the paper heads in bf16 unless its name says otherwise; the oracle names exist."""
    from msa_megatron.parallel.cp_layout import build_cp_layout

    seen = set()
    for name, (lens, heads, dtype, budget, dim, cp) in probe.KL_CHECKS_CP.items():
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        layout = build_cp_layout(cu, cp[0], cp[1], 1, torch.device("cpu"))
        assert layout.total_local * cp[0] == sum(lens) in (4096, 4100), name
        assert dtype == torch.bfloat16 and dim == probe.HEAD_DIM, name
        assert heads == (64, 4, 4, 1) or "hpi4" in name, name
        seen.add((tuple(lens), cp))
    assert {((4096,), (2, 0)), ((4096,), (2, 1)), ((1000, 40, 3060), (2, 1)),
            ((4096,), (4, 2))} <= seen
    everything = {**probe.KL_CHECKS, **probe.KL_CHECKS_WIDE, **probe.KL_CHECKS_CP}
    assert set(probe.KL_REFERENCE) <= set(everything)


def test_kl_check_cp_dry_run_on_cpu(probe, tmp_path):
    """``run_kl_check`` on the CP cases' layouts, scaled down (1/32 of the tokens, Hq 8, D 32,
    fp16: the interpreter's bf16 differs from pass A's by the dz rounding), with the torch pass
    A: the rows say the Gluon path is off on the CPU and record the comparison anyway."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    from msa_megatron.ops.triton import dense_kl_gluon as dkg

    small = {}
    for name, (lens, heads, dtype, budget, dim, cp) in probe.KL_CHECKS_CP.items():
        step = 2 * cp[0]
        lens = [max(step, n // 32 // step * step) for n in lens]
        small[name] = (lens, (8, 2, 2, 1), torch.float16, None if budget is None else 1, 32, cp)
    path = tmp_path / "cp.json"
    entry = probe.run_kl_check(str(path), device="cpu", checks=small, pass_a=dkg.pass_a_torch)
    assert json.loads(path.read_text()) == json.loads(json.dumps(entry))
    assert set(entry) == set(small)
    for name, row in entry.items():
        cp = small[name][5]
        assert (row["cp_size"], row["cp_rank"]) == cp, name
        assert row["query_rows"] * cp[0] == row["key_rows"] == sum(small[name][0]), name
        assert not row["supported"] and "CUDA" in row["why"], name
        assert row["bitwise_repeat"] and row["finite"], name
        assert max(row["vs_triton"].values()) < 1e-4, (name, row["vs_triton"])
    oracle = entry["cp2_r1_hpi4_bf16"]
    assert max(oracle["gluon_vs_float64"].values()) < 1e-2, oracle


def test_kl_child_check_cp_runs_the_cp_cases(probe, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(probe, "run_kl_check", lambda path, checks=None: seen.append(checks))
    assert probe.run_kl_child("check_cp", str(tmp_path / "x.json"), []) == 0
    assert seen == [probe.KL_CHECKS_CP]
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main(["--kl-child", "check_cp", str(tmp_path / "x.json")]) == 2
