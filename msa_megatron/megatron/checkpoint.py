"""Dense -> MSA checkpoint conversion through megatron-core distributed checkpointing.

The paper's conversion path: load a dense GPT checkpoint into the MSA model (the index
projections and index norms keep their fresh initialisation), train in dense warmup mode, then
switch to sparse (:func:`msa_megatron.megatron.apply_msa_warmup`). MSA checkpoints themselves need
nothing special: every MSA parameter is in the model's ``sharded_state_dict`` (``linear_q_idx``
sharded over TP like ``linear_qkv``, the rest replicated), so they save, load and reshard to
another TP size like any megatron-core parameter.
"""

from __future__ import annotations

from typing import Iterable, List, Union

import torch
from megatron.core import dist_checkpointing

MSA_PARAMETER_NAMES = ("linear_q_idx", "linear_k_idx", "q_idx_norm", "k_idx_norm")


def msa_only_keys(state_dict_keys: Iterable[str]) -> List[str]:
    """The keys of MSA-only parameters (absent from a dense checkpoint)."""
    return [key for key in state_dict_keys
            if any(f".{name}." in f".{key}" for name in MSA_PARAMETER_NAMES)]


def load_dense_checkpoint(model: Union[torch.nn.Module, List[torch.nn.Module]],
                          checkpoint_dir: str) -> List[str]:
    """Load a dense megatron-core GPT checkpoint (distributed format) into an MSA model.

    Collective over all ranks. The checkpoint may have been saved at another TP size.

    Args:
        model: the MSA GPT model (or megatron's list of model chunks, one per virtual stage;
            the checkpoint then holds ``model0``, ``model1``, ... as Megatron-LM saves them).
        checkpoint_dir: directory written by ``dist_checkpointing.save``.

    Returns:
        The MSA-only keys that were left at their initial values.
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    skipped: List[str] = []
    sharded = {}
    for i, chunk in enumerate(chunks):
        chunk_sd = chunk.sharded_state_dict()
        fresh = msa_only_keys(chunk_sd)
        skipped.extend(fresh)
        for key in fresh:
            del chunk_sd[key]
        sharded[f"model{i}" if len(chunks) > 1 else "model"] = chunk_sd
    loaded = dist_checkpointing.load(sharded, checkpoint_dir)
    for i, chunk in enumerate(chunks):
        state = loaded[f"model{i}" if len(chunks) > 1 else "model"]
        missing, unexpected = chunk.load_state_dict(state, strict=False)
        wrong = [k for k in missing if k not in skipped and not k.endswith("_extra_state")]
        if wrong or unexpected:
            raise RuntimeError(
                f"dense checkpoint does not match the MSA model: missing {wrong}, "
                f"unexpected {list(unexpected)}"
            )
    return skipped
