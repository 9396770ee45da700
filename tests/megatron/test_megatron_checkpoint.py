"""MSA parameters through megatron-core distributed checkpointing: save at TP=2, resume at TP=2
and at TP=1 with the same next-step loss, for both layouts of the index key projection
(replicated with Hik=1 at TP=2, split over TP with Hik=2 at TP=2, resumed where it is replicated:
TP=4); a dense GPT checkpoint (TP=2) loads into the MSA model (TP=1) with fresh index
projections (the dense -> warmup -> sparse conversion path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist_utils import cuda_device_as_cpu, run_distributed, selected_device
from tests.support.gpt_harness import (
    BATCH,
    Setup,
    batch,
    build_model,
    full_tensor,
    tolerance,
    train,
)

pytestmark = pytest.mark.slow

SETUP = Setup(formats=["sbhd", "thd"])
SHARDED_KEYS = dataclasses.replace(SETUP, index_key_heads=2, index_heads=4)
LOCAL = dataclasses.replace(SETUP, use_te=False)  # parameter names of the dense local GPT


def _next_loss(model) -> torch.Tensor:
    tokens, positions, packed = batch(1, "thd")
    with torch.no_grad():
        return model(tokens, positions, None, labels=tokens, packed_seq_params=packed).mean().cpu()


def _index_params(model) -> dict:
    return {n: full_tensor(p) for n, p in model.named_parameters() if "_idx" in n}


def _save_msa(rank: int, world_size: int, path: str, setup: Setup) -> dict:
    from megatron.core import dist_checkpointing

    model = build_model(setup, world_size)
    train(model, setup, steps=1)
    with cuda_device_as_cpu():
        dist_checkpointing.save(model.sharded_state_dict(), path)
    return {"loss": _next_loss(model), "index_params": _index_params(model)}


def _resume_msa(rank: int, world_size: int, path: str, setup: Setup) -> dict:
    from megatron.core import dist_checkpointing

    model = build_model(dataclasses.replace(setup, seed=7), world_size)
    with cuda_device_as_cpu():
        state = dist_checkpointing.load(model.sharded_state_dict(), path)
    model.load_state_dict(state)
    return {"loss": _next_loss(model), "index_params": _index_params(model)}


@pytest.mark.parametrize("setup,resume_tps", [(SETUP, (2, 1)), (SHARDED_KEYS, (4,))],
                         ids=["replicated-index-keys", "tp-split-index-keys"])
def test_msa_checkpoint_resume_and_reshard(tmp_path, setup, resume_tps):
    path = str(tmp_path / "msa")
    (tmp_path / "msa").mkdir()
    expected = run_distributed(_save_msa, 2, args=(path, setup), tp=2)[0]
    for tp in resume_tps:
        for resumed in run_distributed(_resume_msa, tp, args=(path, setup), tp=tp):
            torch.testing.assert_close(resumed["loss"], expected["loss"],
                                       **tolerance(rtol=1e-5, atol=1e-6))
            assert resumed["index_params"].keys() == expected["index_params"].keys()
            for name, weight in expected["index_params"].items():
                torch.testing.assert_close(resumed["index_params"][name], weight, rtol=0, atol=0,
                                           msg=f"{name} at TP={tp}")


def _save_dense(rank: int, world_size: int, path: str) -> dict:
    """A dense megatron-core GPT (local layers) saved at TP=2; returns its full weights."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    msa_model = build_model(LOCAL, world_size)  # only for its TransformerConfig
    torch.manual_seed(99)
    dense = GPTModel(config=msa_model.config,
                     transformer_layer_spec=get_gpt_layer_local_spec(
                         qk_layernorm=True, normalization="RMSNorm"),
                     vocab_size=msa_model.vocab_size, max_sequence_length=SETUP.seq * BATCH,
                     position_embedding_type="rope").to(selected_device())  # NCCL: on the GPU
    with cuda_device_as_cpu():
        dist_checkpointing.save(dense.sharded_state_dict(), path)
    return {n: full_tensor(p) for n, p in dense.named_parameters()}


def _load_dense(rank: int, world_size: int, path: str) -> dict:
    from msa_megatron.megatron import load_dense_checkpoint, set_msa_mode

    model = build_model(LOCAL, world_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with cuda_device_as_cpu():
        skipped = load_dense_checkpoint(model, path)
    set_msa_mode(model, "dense")
    loss = _next_loss(model)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "before": before, "skipped": skipped, "loss": loss}


def test_dense_checkpoint_into_msa_model(tmp_path):
    path = str(tmp_path / "dense")
    (tmp_path / "dense").mkdir()
    dense = run_distributed(_save_dense, 2, args=(path,), tp=2)[0]
    loaded = run_distributed(_load_dense, 1, args=(path,), tp=1)[0]
    msa_names = {n for n in loaded["params"] if "_idx" in n}
    assert msa_names and set(dense) == set(loaded["params"]) - msa_names
    for name, weight in dense.items():
        torch.testing.assert_close(loaded["params"][name], weight, rtol=0, atol=0, msg=name)
        if weight.dim() == 2:  # matrices start from another random init (norms start at 1)
            assert not torch.equal(loaded["before"][name], weight), f"{name} was not loaded"
    for name in msa_names:
        assert torch.equal(loaded["params"][name], loaded["before"][name])
    assert all("_idx" in key for key in loaded["skipped"]) and loaded["skipped"]
    assert torch.isfinite(loaded["loss"])


def _dense_load_error(rank: int, world_size: int, path: str, setup: Setup):
    """The error ``load_dense_checkpoint`` raises for ``path`` into a model of ``setup``."""
    from msa_megatron.megatron import load_dense_checkpoint

    model = build_model(setup, world_size)
    try:
        with cuda_device_as_cpu():
            load_dense_checkpoint(model, path)
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _save_msa_model(rank: int, world_size: int, path: str) -> None:
    from megatron.core import dist_checkpointing

    model = build_model(LOCAL, world_size)
    with cuda_device_as_cpu():
        dist_checkpointing.save(model.sharded_state_dict(), path)


def test_dense_load_refuses_what_it_would_drop_or_leave_uninitialised(tmp_path):
    """Tensors of the checkpoint the model has no place for (q/k norms into a model without),
    an MSA checkpoint (its trained index would be re-initialised) and a model built without
    initialization (the index projections would keep uninitialised memory) are refused."""
    dense, msa = tmp_path / "dense", tmp_path / "msa"
    dense.mkdir(), msa.mkdir()
    run_distributed(_save_dense, 2, args=(str(dense),), tp=2)  # with q/k norms
    no_norms = dataclasses.replace(LOCAL, qk_layernorm=False)
    error = run_distributed(_dense_load_error, 1, args=(str(dense), no_norms), tp=1)[0]
    assert error and error.startswith("RuntimeError") and "no parameter for" in error, error
    assert "self_attention.q_layernorm.weight" in error, error
    run_distributed(_save_msa_model, 1, args=(str(msa),), tp=1)
    error = run_distributed(_dense_load_error, 1, args=(str(msa), LOCAL), tp=1)[0]
    assert error and "already holds MSA index weights" in error and "linear_q_idx" in error, error
    no_init = dataclasses.replace(LOCAL, config_extra={"perform_initialization": False})
    error = run_distributed(_dense_load_error, 1, args=(str(dense), no_init), tp=1)[0]
    assert error and error.startswith("ValueError") and "--no-initialization" in error, error


class _NormWithExtraState(torch.nn.RMSNorm):
    """An RMSNorm with (empty) extra state, as Transformer Engine's norms have: stands in for
    the unfused TE input norm, whose ``_extra_state`` a fused dense TE layer does not save."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass


def _load_dense_with_norm_extra_state(rank: int, world_size: int, path: str) -> list:
    from msa_megatron.megatron import compat, load_dense_checkpoint

    base_spec = compat.gpt_layer_base_spec

    def with_extra_state(*args, **kwargs):
        spec = base_spec(*args, **kwargs)
        spec.submodules.input_layernorm = _NormWithExtraState
        return spec

    compat.gpt_layer_base_spec = with_extra_state  # this rank's process only
    model = build_model(LOCAL, world_size)
    assert any(k.endswith("input_layernorm._extra_state") for k in model.state_dict())
    with cuda_device_as_cpu():
        return load_dense_checkpoint(model, path)


def test_dense_load_passes_over_extra_state_the_checkpoint_lacks(tmp_path):
    """``_extra_state`` the model has and the dense checkpoint lacks holds no weights: the load
    goes on (megatron-core's default strictness failed on the missing key)."""
    run_distributed(_save_dense, 2, args=(str(tmp_path),), tp=2)
    skipped = run_distributed(_load_dense_with_norm_extra_state, 1, args=(str(tmp_path),), tp=1)[0]
    assert skipped and all("_idx" in key for key in skipped)
