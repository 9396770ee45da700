"""Bad input (MSA_SPEC section 7): the right error type, a message naming the argument, raised
before any backend computes, for ``select_blocks`` and ``msa_attention`` and every backend name;
plus :class:`msa_megatron.MSAConfig` validation."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, NamedTuple, Type

import numpy as np
import pytest
import torch

from msa_megatron import MSAConfig, msa_attention, select_blocks
from msa_megatron.core import MSAOptions
from msa_megatron.ops.backends import get_backend
from tests.support.inputs import make_inputs

BACKEND_NAMES = ["reference", "torch", "triton", None]
# CUDA where there is a GPU (the Triton kernels then run compiled), else the CPU (interpreter)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ComputeCalled(AssertionError):
    """Raised by the patched backend cores: validation let the input through."""


def _compute(*args, **kwargs):
    raise ComputeCalled("a backend core ran")


@pytest.fixture(autouse=True)
def no_compute(monkeypatch):
    """Every backend core raises :class:`ComputeCalled` if reached."""
    for name in ("reference", "torch", "triton"):
        module = get_backend(name)
        for core in ("select", "attention", "kl"):
            monkeypatch.setattr(module, core, _compute)


def _valid() -> Dict[str, object]:
    """Valid arguments for every backend: lengths 20 + 12, Hq 4, Hkv 2, Hi 2, Hik 1, D = Di 16."""
    x = make_inputs((20, 12), heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                    head_dim=16, index_head_dim=16, requires_grad=False, seed=0, device=DEVICE)
    return dict(x, block_size=16, top_k=2)


def _tensor(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).to(DEVICE)


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


class Bad(NamedTuple):
    change: Callable[[Dict[str, object]], None]  # edits the valid arguments in place
    error: Type[Exception]
    match: str  # regex the message must contain (names the argument)
    index_only: bool = True  # also applies to select_blocks


def _set(**values):
    def change(a):
        a.update({k: (v(a) if callable(v) else v) for k, v in values.items()})
    return change


BAD = {
    # dtypes and devices
    "dtype_mismatch": Bad(_set(k_idx=lambda a: a["k_idx"].double()), TypeError, r"k_idx has dtype"),
    "dtype_mismatch_main": Bad(_set(v=lambda a: a["v"].double()), TypeError, r"v has dtype", False),
    "unsupported_dtype": Bad(_set(**{n: (lambda n: lambda a: a[n].to(torch.int8))(n) for n in
                                     ("q", "k", "v", "q_idx", "k_idx")}),
                             TypeError, r"(q|q_idx) has unsupported dtype"),
    "device_mismatch": Bad(_set(k_idx=lambda a: a["k_idx"].to("meta")), ValueError,
                           r"k_idx is on meta"),
    "device_mismatch_main": Bad(_set(k=lambda a: a["k"].to("meta")), ValueError,
                                r"k is on meta", False),
    "not_a_tensor": Bad(_set(q_idx=lambda a: a["q_idx"].tolist()), TypeError,
                        r"q_idx must be a torch.Tensor"),
    "wrong_ndim": Bad(_set(q_idx=lambda a: a["q_idx"][:, 0]), ValueError,
                      r"q_idx must have 3 dims"),
    "wrong_ndim_main": Bad(_set(q=lambda a: a["q"][:, 0]), ValueError, r"q must have 3 dims",
                           False),
    # head counts
    "Hq_not_multiple_of_Hkv": Bad(_set(q=_tensor(32, 3, 16)), ValueError, r"Hq=3 .*Hkv=2", False),
    "Hq_not_multiple_of_Hi": Bad(_set(q=_tensor(32, 6, 16), q_idx=_tensor(32, 4, 16)),
                                 ValueError, r"Hq=6 .*Hi=4", False),
    "Hi_not_multiple_of_Hkv": Bad(_set(q_idx=_tensor(32, 1, 16)), ValueError, r"Hi=1 .*Hkv=2",
                                  False),
    "Hi_not_multiple_of_Hik": Bad(_set(k_idx=_tensor(32, 3, 16)), ValueError, r"Hi=2 .*Hik=3"),
    # head dims
    "k_head_dim": Bad(_set(k=_tensor(32, 2, 8), v=_tensor(32, 2, 8)), ValueError,
                      r"q \[32, 4, 16\] and k \[32, 2, 8\] disagree on the head dim D", False),
    "v_shape": Bad(_set(v=_tensor(32, 2, 8)), ValueError, r"k \[.*\] and v \[.*\]", False),
    "index_head_dim": Bad(_set(k_idx=_tensor(32, 1, 8)), ValueError, r"q_idx .* k_idx .* Di"),
    # token counts
    "T_mismatch_index": Bad(_set(k_idx=_tensor(31, 1, 16)), ValueError, r"q_idx .* k_idx .*T"),
    "T_mismatch_main": Bad(_set(k=_tensor(33, 2, 16), v=_tensor(33, 2, 16)), ValueError,
                           r"T disagrees: q .* k \[33", False),
    # options
    "block_size_not_power_of_two": Bad(_set(block_size=48), ValueError, r"block_size"),
    "block_size_too_small": Bad(_set(block_size=8), ValueError, r"block_size"),
    "block_size_not_int": Bad(_set(block_size=True), TypeError, r"block_size"),
    "top_k_below_forced": Bad(_set(top_k=2, init_blocks=1, local_blocks=2), ValueError, r"top_k"),
    "top_k_not_int": Bad(_set(top_k=2.0), TypeError, r"top_k"),
    "local_blocks_zero": Bad(_set(local_blocks=0), ValueError, r"local_blocks"),
    "init_blocks_negative": Bad(_set(init_blocks=-1), ValueError, r"init_blocks"),
    "unknown_backend": Bad(_set(backend="cuda"), ValueError, r"backend"),
    "unknown_mode": Bad(_set(mode="sparse2"), ValueError, r"mode", False),
    "softmax_scale_negative": Bad(_set(softmax_scale=-1.0), ValueError, r"softmax_scale", False),
    "index_scale_nan": Bad(_set(index_scale=math.nan), ValueError, r"index_scale"),
    "index_scale_not_number": Bad(_set(index_scale="0.1"), TypeError, r"index_scale"),
    "softmax_scale_not_number": Bad(_set(softmax_scale="1"), TypeError, r"softmax_scale", False),
    "backend_not_str": Bad(_set(backend=1), TypeError, r"backend"),
    "mode_not_str": Bad(_set(mode=1), TypeError, r"mode", False),
    # cu_seqlens
    "cu_seqlens_int64": Bad(_set(cu_seqlens=_cu(0, 20, 32, dtype=torch.int64)), TypeError,
                            r"cu_seqlens must be int32"),
    "cu_seqlens_list": Bad(_set(cu_seqlens=[0, 20, 32]), TypeError,
                           r"cu_seqlens must be a torch.Tensor"),
    "cu_seqlens_2d": Bad(_set(cu_seqlens=_cu(0, 20, 32)[None]),
                         ValueError, r"cu_seqlens must be 1-D"),
    "cu_seqlens_decreasing": Bad(_set(cu_seqlens=_cu(0, 20, 10, 32)),
                                 ValueError, r"cu_seqlens must be non-decreasing"),
    "cu_seqlens_first_not_zero": Bad(_set(cu_seqlens=_cu(1, 20, 32)),
                                     ValueError, r"cu_seqlens\[0\]"),
    "cu_seqlens_last_not_T": Bad(_set(cu_seqlens=_cu(0, 20, 30)),
                                 ValueError, r"cu_seqlens\[-1\] must equal T=32"),
    "cu_seqlens_other_device": Bad(_set(cu_seqlens=lambda a: a["cu_seqlens"].to("meta")),
                                   ValueError, r"cu_seqlens is on meta"),
}

_MAIN_ONLY = ("q", "k", "v", "mode", "softmax_scale")


def _call_select(args):
    kwargs = {k: v for k, v in args.items() if k not in _MAIN_ONLY}
    return select_blocks(kwargs.pop("q_idx"), kwargs.pop("k_idx"), kwargs.pop("cu_seqlens"),
                         **kwargs)


def _call_attention(args):
    kwargs = dict(args)
    tensors = [kwargs.pop(n) for n in ("q", "k", "v", "q_idx", "k_idx", "cu_seqlens")]
    return msa_attention(*tensors, **kwargs)


ENTRY_POINTS = {"select_blocks": _call_select, "msa_attention": _call_attention}


@pytest.mark.parametrize("backend", BACKEND_NAMES, ids=str)
@pytest.mark.parametrize("case,entry", [(c, e) for c in BAD for e in ENTRY_POINTS
                                        if e == "msa_attention" or BAD[c].index_only])
def test_bad_input_raises_before_compute(case, entry, backend):
    bad = BAD[case]
    args = _valid()
    args["backend"] = backend
    bad.change(args)
    with pytest.raises(bad.error, match=bad.match):
        ENTRY_POINTS[entry](args)


@pytest.mark.parametrize("backend", BACKEND_NAMES, ids=str)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_valid_input_reaches_compute(entry, backend):
    """The fixture's valid arguments pass validation (so the bad cases above test one fault)."""
    args = _valid()
    args["backend"] = backend
    with pytest.raises(ComputeCalled):
        ENTRY_POINTS[entry](args)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_references_accept_any_head_dim_block_size_and_float64(entry, backend):
    args = _valid()
    x = make_inputs((20, 12), heads=4, kv_heads=2, index_heads=2, head_dim=24, index_head_dim=40,
                    dtype=torch.float64, requires_grad=False, seed=1, device=DEVICE)
    args.update(x, block_size=256, backend=backend)
    with pytest.raises(ComputeCalled):
        ENTRY_POINTS[entry](args)


TRITON_LIMITS = {
    "float64": (dict(dtype=torch.float64), {}, TypeError, r"backend='triton' supports dtypes"),
    "head_dim_24": (dict(head_dim=24), {}, ValueError,
                    r"backend='triton' supports D .*, got 24; backend='torch' runs any head dim"),
    "index_head_dim_40": (dict(index_head_dim=40), {}, ValueError,
                          r"backend='triton' supports Di .*backend='torch' runs any head dim"),
    "block_size_256": ({}, dict(block_size=256), ValueError,
                       r"backend='triton' supports block_size"),
}


@pytest.mark.parametrize("case,entry", [(c, e) for c in TRITON_LIMITS for e in ENTRY_POINTS
                                        if e == "msa_attention" or c != "head_dim_24"])
def test_triton_limits_raise_before_launch(case, entry):
    """Triton's own dtype / head-dim / block-size limits (checked on every device)."""
    input_options, call_options, error, match = TRITON_LIMITS[case]
    args = _valid()
    args.update(make_inputs((20, 12), heads=4, kv_heads=2, index_heads=2, requires_grad=False,
                            seed=2, device=DEVICE, **input_options))
    args.update(call_options, backend="triton")
    with pytest.raises(error, match=match):
        ENTRY_POINTS[entry](args)


def test_triton_int32_entry_numbering_limit_is_named():
    """T * Hi * top_k >= 2^31 selected entries: ValueError before any kernel (meta tensors, so
    no memory is touched); selection alone has no such limit; just under the limit passes."""
    from msa_megatron.ops.validation import check_backend_limits

    for ok in ((2 ** 20, 4, 16), None):
        check_backend_limits("triton", torch.bfloat16, {"D": 128}, 128, torch.device("meta"),
                             selection=ok)
    with pytest.raises(ValueError, match=r"T=1048576 tokens x Hi=64 index heads x top_k=32"):
        check_backend_limits("triton", torch.bfloat16, {"D": 128}, 128, torch.device("meta"),
                             selection=(2 ** 20, 64, 32))
    t, hi = 2 ** 20, 64
    q = torch.empty(t, hi, 16, dtype=torch.float16, device="meta")
    kv = torch.empty(t, 1, 16, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="lower top_k"):
        msa_attention(q, kv, kv, q, kv, block_size=16, top_k=32, backend="triton")


BAD_CONFIGS = {
    "block_size_not_power_of_two": (dict(block_size=96), ValueError, r"block_size"),
    "block_size_not_int": (dict(block_size=128.0), TypeError, r"block_size"),
    "top_k_below_forced": (dict(top_k=2, init_blocks=2, local_blocks=1), ValueError, r"top_k"),
    "local_blocks_zero": (dict(local_blocks=0), ValueError, r"local_blocks"),
    "init_blocks_negative": (dict(init_blocks=-1), ValueError, r"init_blocks"),
    "index_key_heads_zero": (dict(index_key_heads=0), ValueError, r"index_key_heads"),
    "index_heads_not_multiple": (dict(index_heads=3, index_key_heads=2), ValueError,
                                 r"index_heads"),
    "index_heads_not_int": (dict(index_heads="4"), TypeError, r"index_heads"),
    "index_head_dim_zero": (dict(index_head_dim=0), ValueError, r"index_head_dim"),
    "softmax_scale_zero": (dict(softmax_scale=0.0), ValueError, r"softmax_scale"),
    "index_scale_negative": (dict(index_scale=-0.1), ValueError, r"index_scale"),
    "kl_coeff_negative": (dict(kl_coeff=-1.0), ValueError, r"kl_coeff"),
    "unknown_mode": (dict(mode="warmup"), ValueError, r"mode"),
    "unknown_backend": (dict(backend="cutlass"), ValueError, r"backend"),
    "unknown_cp_exchange": (dict(cp_kv_exchange="ring"), ValueError, r"cp_kv_exchange"),
    "softmax_scale_bool": (dict(softmax_scale=True), TypeError, r"softmax_scale"),
    "softmax_scale_str": (dict(softmax_scale="1"), TypeError, r"MSAConfig.softmax_scale"),
    "kl_coeff_bool": (dict(kl_coeff=True), TypeError, r"kl_coeff"),
    "kl_coeff_str": (dict(kl_coeff="1"), TypeError, r"MSAConfig.kl_coeff"),
    "mode_not_str": (dict(mode=1), TypeError, r"mode"),
    "backend_not_str": (dict(backend=1), TypeError, r"backend"),
    "cp_exchange_not_str": (dict(cp_kv_exchange=1), TypeError, r"cp_kv_exchange"),
    "triton_block_256": (dict(backend="triton", block_size=256), ValueError,
                         r"triton.*block_size"),
    "triton_index_head_dim_96": (dict(backend="triton", index_head_dim=96), ValueError,
                                 r"triton.*index_head_dim"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_config_rejects_bad_values(case):
    kwargs, error, match = BAD_CONFIGS[case]
    with pytest.raises(error, match=match):
        MSAConfig(**kwargs)


# Options MSAConfig shares with msa_attention, and wrong values for them: a wrong type is a
# TypeError and a bad value a ValueError in both, each message naming the option.
T, V = TypeError, ValueError
SHARED_OPTION_VALUES = {
    "block_size": [("16", T), (16.0, T), (True, T), (None, T), (48, V), (8, V)],
    "top_k": [("2", T), (2.0, T), (False, T), (None, T), (0, V), (-1, V)],
    "init_blocks": [("0", T), (0.0, T), (True, T), (-1, V)],
    "local_blocks": [("1", T), (1.0, T), (True, T), (0, V)],
    "softmax_scale": [("1", T), (True, T), (0.0, V), (-1.0, V), (math.nan, V), (math.inf, V)],
    "index_scale": [("1", T), (False, T), (0, V), (-0.5, V), (math.nan, V), (-math.inf, V)],
    "mode": [(1, T), (None, T), ("warmup", V)],
    "backend": [(1, T), ("cuda", V)],
}


@pytest.mark.parametrize("name,value,error", [(n, v, e) for n, pairs in SHARED_OPTION_VALUES.items()
                                              for v, e in pairs], ids=repr)
def test_config_and_op_raise_the_same_error(name, value, error):
    args = _valid()
    args[name] = value
    with pytest.raises(error, match=name):
        _call_attention(args)
    with pytest.raises(error, match=name):
        MSAConfig(**{"block_size": 16, name: value})


NUMPY_OPTIONS = dict(block_size=np.int64(16), top_k=np.int32(3), init_blocks=np.int16(1),
                     local_blocks=np.uint8(1), softmax_scale=np.float32(0.5),
                     index_scale=np.int64(1))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_numpy_numbers_reach_the_backend_as_python_numbers(entry, monkeypatch):
    """Any integral number (numpy integers) is an int option, any real number a scale; the
    backend core gets plain int / float."""
    seen = {}

    def record(*args, **kwargs):
        seen.update(kwargs)
        raise ComputeCalled("recorded")

    module = get_backend("torch")
    monkeypatch.setattr(module, "select", record)
    args = _valid()
    args.update(NUMPY_OPTIONS, backend="torch")
    with pytest.raises(ComputeCalled):
        ENTRY_POINTS[entry](args)
    assert seen["top_k"] == 3 and seen["index_scale"] == 1.0
    assert {k: type(v) for k, v in seen.items() if v is not None} == {
        "block_size": int, "top_k": int, "init_blocks": int, "local_blocks": int,
        "index_scale": float}


def test_numpy_numbers_in_options_and_config_are_stored_as_python_numbers():
    options = MSAOptions(**NUMPY_OPTIONS)
    cfg = MSAConfig(**NUMPY_OPTIONS, index_heads=np.int64(4), index_key_heads=np.int64(2),
                    index_head_dim=np.int32(64), kl_coeff=np.float32(0.25))
    assert cfg == MSAConfig(block_size=16, top_k=3, init_blocks=1, local_blocks=1,
                            softmax_scale=0.5, index_scale=1.0, index_heads=4, index_key_heads=2,
                            index_head_dim=64, kl_coeff=0.25)
    for holder in (options, cfg):
        for field in dataclasses.fields(holder):
            value = getattr(holder, field.name)
            assert type(value) in (int, float, str, bool, type(None)), (field.name, type(value))
    assert MSAOptions.from_config(cfg).top_k == 3
    with pytest.raises(TypeError, match="top_k"):
        MSAConfig(top_k=np.bool_(True))


def test_config_defaults_are_the_paper_defaults():
    cfg = MSAConfig()
    assert (cfg.block_size, cfg.top_k, cfg.init_blocks, cfg.local_blocks) == (128, 16, 0, 1)
    assert (cfg.index_key_heads, cfg.index_head_dim, cfg.mode) == (1, 128, "sparse")
    assert cfg.resolved_index_heads(4) == 4
    assert MSAConfig(index_heads=8).resolved_index_heads(4) == 8


def test_triton_on_cpu_without_the_interpreter_names_the_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = make_inputs([40], dtype=torch.float16, seed=3)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        msa_attention(x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], x["cu_seqlens"],
                      block_size=16, top_k=2, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        select_blocks(x["q_idx"], x["k_idx"], x["cu_seqlens"], block_size=16, top_k=2,
                      backend="triton")


@pytest.mark.parametrize("field,value", [("softmax_scale", float("inf")),
                                         ("index_scale", float("nan")),
                                         ("kl_coeff", float("nan")),
                                         ("kl_coeff", float("inf"))])
def test_msa_config_rejects_non_finite_numbers(field, value):
    with pytest.raises(ValueError, match=field):
        MSAConfig(**{field: value})


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_batched_4d_input_gets_a_packing_hint(entry):
    """``[B, S, H, D]`` (a padded batch) is rejected with the packed equivalent spelled out."""
    args = _valid()
    args["q_idx"] = args["q_idx"].reshape(2, 16, 2, 16)
    with pytest.raises(ValueError, match=r"q_idx must have 3 dims .*reshape\(B \* S, H, D\) "
                                         r"and cu_seqlens = torch.arange\(B \+ 1"):
        ENTRY_POINTS[entry](args)


def test_config_is_immutable_and_replace_validates():
    cfg = MSAConfig(top_k=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = -5
    assert cfg.top_k == 8
    assert dataclasses.replace(cfg, top_k=4).top_k == 4
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(cfg, top_k=-5)
    assert hash(cfg) == hash(MSAConfig(top_k=8))
