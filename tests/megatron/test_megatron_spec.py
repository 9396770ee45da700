"""The MSA layer spec, the head split over TP, and the megatron-core version switches (in process,
no process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from msa_megatron import MSAConfig
from msa_megatron.megatron import (
    MSACoreAttention,
    MSALayerSpec,
    MSASelfAttention,
    get_gpt_layer_msa_spec,
    get_kl_loss_scale,
    gpt_layer_msa_spec,
    schedule_loss_scale,
    set_kl_loss_scale,
)
from msa_megatron.megatron import compat, spec as spec_module
from msa_megatron.megatron.attention import build_head_layout
from msa_megatron.megatron.checkpoint import msa_only_keys
from msa_megatron.parallel.tensor import index_head_layout
from tests.dist_utils import run_distributed


def _config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                  kv_channels=16, use_cpu_initialization=True)
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_spec_structure():
    msa = MSAConfig(top_k=4, block_size=32)
    spec = get_gpt_layer_msa_spec(msa, use_te=False, qk_layernorm=True)
    assert isinstance(spec, ModuleSpec) and spec.module is TransformerLayer
    attention = spec.submodules.self_attention
    assert attention.module is MSASelfAttention
    assert attention.params["msa_config"] is msa
    assert attention.submodules.core_attention is MSACoreAttention
    assert attention.submodules.linear_q_idx is attention.submodules.linear_qkv
    plain = get_gpt_layer_msa_spec(msa, use_te=False)
    assert plain.submodules.self_attention.submodules.q_layernorm is not \
        attention.submodules.q_layernorm


def test_te_requested_without_te():
    if compat.HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(ImportError, match="transformer_engine"):
        get_gpt_layer_msa_spec(MSAConfig(), use_te=True)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(msa_config={"top_k": 4}), TypeError, "msa_config must be an MSAConfig"),
    (dict(msa_config={}), TypeError, "msa_config must be an MSAConfig"),
    (dict(msa_config="dense"), TypeError, "msa_config must be an MSAConfig"),
    (dict(use_te="no"), TypeError, "use_te must be a bool or None"),
    (dict(qk_layernorm="no"), TypeError, "qk_layernorm must be a bool"),
])
def test_spec_refuses_bad_arguments(kwargs, error, match):
    """A dict, an empty dict or a string is not an MSAConfig (an empty one was taken for the
    defaults, a filled one failed only when the layer was built); a string flag was read as
    True."""
    msa_config = kwargs.pop("msa_config", None)
    with pytest.raises(error, match=match):
        get_gpt_layer_msa_spec(msa_config, **kwargs)


def test_spec_object_for_megatron_lm(monkeypatch):
    """``--spec msa_megatron.megatron.spec gpt_layer_msa_spec``: a ModuleSpec (0.16 builders)
    that builders calling it with the config (0.19) turn into a config-matched spec."""
    assert isinstance(gpt_layer_msa_spec, ModuleSpec)
    assert isinstance(gpt_layer_msa_spec, MSALayerSpec)
    monkeypatch.setenv(spec_module.MSA_CONFIG_ENV, json.dumps({"top_k": 5, "mode": "dense"}))
    built = gpt_layer_msa_spec(_config(qk_layernorm=True))
    msa = built.submodules.self_attention.params["msa_config"]
    assert (msa.top_k, msa.mode) == (5, "dense")
    assert built.submodules.self_attention.submodules.q_layernorm is not None
    assert gpt_layer_msa_spec() is gpt_layer_msa_spec


@pytest.mark.parametrize("text, error", [("{bad", "not valid JSON"), ("[1]", "JSON object"),
                                         ('{"topk": 3}', "unknown MSAConfig fields"),
                                         ('{"top_k": 0}', r"^\$MSA_CONFIG: top_k")])
def test_msa_config_env_errors(monkeypatch, text, error):
    monkeypatch.setenv(spec_module.MSA_CONFIG_ENV, text)
    with pytest.raises(ValueError, match=error):
        spec_module.msa_config_from_env()
    with pytest.raises(ValueError, match=error):  # where the --spec object's layers are built
        spec_module.spec_for_config(_config())


def test_invalid_msa_config_env_does_not_break_the_import():
    """Routes that never read ``$MSA_CONFIG`` (pretrain_tiny, the patched entry point) import
    msa_megatron.megatron; a bad value is refused where the --spec layers are built."""
    env = dict(os.environ, MSA_CONFIG='{"top_k": 0}')
    code = ("import msa_megatron.megatron as m, msa_megatron.megatron.spec as s\n"
            "try:\n    s.spec_for_config(s.TransformerConfig(num_layers=1, hidden_size=8, "
            "num_attention_heads=2, use_cpu_initialization=True))\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: $MSA_CONFIG: top_k" in done.stdout


@pytest.mark.parametrize("heads, groups, index_heads, tp, expected", [
    (8, 2, None, 1, (0, 2, 0, 1, 1)),
    (8, 2, None, 2, (1, 1, 0, 1, 1)),
    (8, 2, None, 4, (1, 1, 0, 1, 2)),      # TP > Hkv: 2 ranks share an index head
    (64, 4, None, 8, (3, 1, 0, 1, 2)),     # the paper's model at TP 8, rank 7
    (16, 2, 4, 4, (3, 1, 0, 1, 1)),        # Hi > Hkv, Hi == TP: nothing shared
])
def test_head_layout(heads, groups, index_heads, tp, expected):
    config = SimpleNamespace(num_attention_heads=heads, num_query_groups=groups)
    rank = tp - 1 if tp > 1 else 0
    layout = build_head_layout(config, MSAConfig(index_heads=index_heads), tp, rank)
    assert (layout.index_first, layout.index_count, layout.key_first, layout.key_count,
            layout.share) == expected


def test_head_layout_errors():
    config = SimpleNamespace(num_attention_heads=12, num_query_groups=3)
    with pytest.raises(ValueError, match="divide one another"):
        build_head_layout(config, MSAConfig(), 2, 0)
    with pytest.raises(ValueError, match="Hi % Hkv"):
        build_head_layout(SimpleNamespace(num_attention_heads=8, num_query_groups=4),
                          MSAConfig(index_heads=2), 1, 0)
    with pytest.raises(ValueError, match="divide one another"):
        index_head_layout(6, 4, 0)



def test_loss_scale_hook_0_19_path():
    """0.19's schedule calls config.experimental_attention_variant_loss_scale_func; 0.16's
    config has no such field and the hook is not installed."""
    config = SimpleNamespace(**{compat.LOSS_SCALE_HOOK_FIELD: None})
    assert compat.install_kl_loss_scale_hook(config, set_kl_loss_scale)
    getattr(config, compat.LOSS_SCALE_HOOK_FIELD)(torch.tensor(0.25))
    assert get_kl_loss_scale() == 0.25
    set_kl_loss_scale(1.0)
    other = SimpleNamespace(**{compat.LOSS_SCALE_HOOK_FIELD: print})
    with pytest.raises(ValueError, match="already set"):
        compat.install_kl_loss_scale_hook(other, set_kl_loss_scale)
    assert compat.install_kl_loss_scale_hook(SimpleNamespace(), set_kl_loss_scale) is False
    assert compat.has_loss_scale_hook(_config()) == (compat.megatron_core_version() >= (0, 19))


@pytest.mark.parametrize("scale, error, match", [
    ("abc", TypeError, "scale must be a float or a 1-element tensor"),
    (None, TypeError, "scale must be a float or a 1-element tensor"),
    (True, TypeError, "scale must be a float or a 1-element tensor"),
    (float("nan"), ValueError, "scale must be a finite number >= 0"),
    (float("inf"), ValueError, "scale must be a finite number >= 0"),
    (-1.0, ValueError, "scale must be a finite number >= 0"),
    (torch.ones(3), ValueError, "1-element"),
])
def test_kl_loss_scale_refuses_bad_values(scale, error, match):
    """A NaN or negative scale would have scaled every index-branch gradient by it, silently;
    a 3-element tensor failed only at backward."""
    set_kl_loss_scale(0.5)
    with pytest.raises(error, match=match):
        set_kl_loss_scale(scale)
    assert get_kl_loss_scale() == 0.5  # unchanged
    set_kl_loss_scale(1.0)


def test_kl_loss_scale_accepts_numbers_and_schedule_tensors():
    for scale, expected in ((0, 0.0), (2, 2.0), (0.25, 0.25), (torch.tensor([0.5]), 0.5),
                            (torch.tensor(0.125, dtype=torch.float64), 0.125)):
        set_kl_loss_scale(scale)
        assert get_kl_loss_scale() == expected
    set_kl_loss_scale(1.0)


def test_msa_only_keys():
    keys = ["decoder.layers.0.self_attention.index.linear_q_idx.weight",
            "decoder.layers.0.self_attention.linear_qkv.weight",
            "decoder.layers.0.self_attention.index.k_idx_norm.weight",
            "decoder.layers.0.self_attention.q_layernorm.weight"]
    assert msa_only_keys(keys) == [keys[0], keys[2]]


def test_schedule_loss_scale_for_0_16():
    config = _config()
    assert float(schedule_loss_scale(config, num_microbatches=4, cp_size=2)) == 0.5
    config.grad_scale_func = lambda x: x * 1024.0
    assert float(schedule_loss_scale(config, num_microbatches=4)) == 256.0
    config.calculate_per_token_loss = True
    assert float(schedule_loss_scale(config, num_microbatches=4, cp_size=2)) == 1024.0


def test_kl_scale_follows_the_0_16_schedule_inside_megatron_training(monkeypatch):
    """0.16 (no hook): layers remember their config; when nobody set a scale and megatron's
    micro-batch calculator exists (Megatron-LM's loop, e.g. the --spec route), the KL gets the
    schedule's scale; without the calculator it stays 1."""
    from megatron.core import num_microbatches_calculator as calculator

    from msa_megatron.megatron import loss as loss_module

    monkeypatch.setattr(loss_module, "_loss_scale", None)
    monkeypatch.setattr(loss_module, "_schedule_config", None)
    config = _config()
    config.grad_scale_func = lambda x: x * 8.0
    assert compat.install_kl_loss_scale_hook(SimpleNamespace(grad_scale_func=None),
                                             set_kl_loss_scale) is False
    assert compat.install_kl_loss_scale_hook(config, set_kl_loss_scale) is False \
        or compat.has_loss_scale_hook(config)
    loss_module.use_schedule_default(config)
    monkeypatch.setattr(calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)
    assert get_kl_loss_scale() == 1.0  # no calculator: not inside megatron.training
    calculator.init_num_microbatches_calculator(0, None, global_batch_size=4, micro_batch_size=1,
                                                data_parallel_size=1)
    try:
        assert get_kl_loss_scale() == 2.0  # grad scale 8 / 4 micro-batches (CP 1)
        kl = torch.tensor(0.5, requires_grad=True)
        out = torch.ones(3, requires_grad=True)
        loss_module.KLLossAutoScaler.apply(out, kl, 0.5).sum().backward()
        assert float(kl.grad) == 0.5 * 2.0
        set_kl_loss_scale(0.25)  # an explicit scale wins
        assert get_kl_loss_scale() == 0.25
    finally:
        calculator.destroy_num_microbatches_calculator()


def _spec_object_worker(rank: int, world_size: int) -> dict:
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import build_module

    out = {}
    for qk in (True, False):
        layer = build_module(gpt_layer_msa_spec,
                             config=_config(qk_layernorm=qk, transformer_impl="local"))
        attention = layer.self_attention
        out[qk] = {"msa": isinstance(attention, MSASelfAttention),
                   "qk_norm": attention.q_layernorm is not None
                   and not isinstance(attention.q_layernorm, IdentityOp),
                   "top_k": attention.msa_config.top_k}
    return out


def test_spec_object_layer_matches_its_config(monkeypatch):
    """The --spec object used as it is (0.19.2's GPT builder does not call a ModuleSpec): the
    layer builds q/k norms for --qk-layernorm and local layers for --transformer-impl local, and
    refuses an implementation MSA has no layers for."""
    from msa_megatron.megatron.spec import ConfigMatchedMSALayer, spec_for_config

    monkeypatch.setenv(spec_module.MSA_CONFIG_ENV, json.dumps({"top_k": 3, "block_size": 16}))
    assert gpt_layer_msa_spec.module is ConfigMatchedMSALayer
    built = run_distributed(_spec_object_worker, 1, tp=1)[0]
    assert built == {True: {"msa": True, "qk_norm": True, "top_k": 3},
                     False: {"msa": True, "qk_norm": False, "top_k": 3}}
    with pytest.raises(ValueError, match="inference_optimized"):
        spec_for_config(SimpleNamespace(transformer_impl="inference_optimized", qk_layernorm=False))
    if not compat.HAVE_TE:
        with pytest.warns(UserWarning, match="Transformer Engine is not installed"):
            spec_for_config(_config(transformer_impl="transformer_engine"))
