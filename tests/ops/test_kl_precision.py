"""KL gradients at a realistic normaliser keep their precision in fp16.

At pretraining scale ``kl_scale = 1 / (N * Hi)`` is ~1e-7 and the index-branch gradients are
smaller still: below fp16's normal range. The backends keep them in fp32 until the incoming
gradient (carrying the fp16 loss scale) is applied, then cast, so a loss scaler recovers them. The oracle runs the same fp16-rounded inputs in fp64.
"""

from __future__ import annotations

import pytest
import torch

from msa_megatron.core import MSAOptions, msa_layer
from tests.support.inputs import make_inputs, rel_err

KL_SCALE = 1.0 / (131072 * 4)  # N = 128K tokens, Hi = 4
LOSS_SCALE = 2.0 ** 16  # what an fp16 loss scaler multiplies the loss by


def _index_grads(inputs, backend, dtype):
    leaves = {name: t.detach().to(dtype).requires_grad_(True) for name, t in inputs.items()
              if name != "cu_seqlens"}
    options = MSAOptions(backend=backend, block_size=16, top_k=3, init_blocks=0, local_blocks=1)
    kl = msa_layer(leaves["q"], leaves["k"], leaves["v"], leaves["q_idx"], leaves["k_idx"],
                   options=options, cu_seqlens=inputs["cu_seqlens"], kl_scale=KL_SCALE).kl
    (kl * LOSS_SCALE).backward()
    grads = (leaves["q_idx"].grad, leaves["k_idx"].grad)
    assert all(g.dtype == dtype for g in grads)
    return tuple(g.to(torch.float64) / LOSS_SCALE for g in grads)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp16_index_gradients_do_not_underflow(backend):
    inputs = make_inputs([70, 45], heads=4, kv_heads=2, index_heads=2, seed=11,
                         requires_grad=False)
    inputs = {n: (t.to(torch.float16) if t.is_floating_point() else t) for n, t in inputs.items()}
    ref_q, ref_k = _index_grads(inputs, "reference", torch.float64)
    got_q, got_k = _index_grads(inputs, backend, torch.float16)
    assert rel_err(got_q, ref_q) < 2e-2, rel_err(got_q, ref_q)
    assert rel_err(got_k, ref_k) < 2e-2, rel_err(got_k, ref_k)
