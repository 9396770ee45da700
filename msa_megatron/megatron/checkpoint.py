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

    Collective over all ranks. The checkpoint may have been saved at another TP size. Every
    model tensor of the checkpoint must find its place in the MSA model and every parameter of
    the model but the MSA-only ones must be in the checkpoint (``_extra_state`` entries, which
    hold no weights, are exempt both ways; tensors outside the model, such as the optimizer's,
    are ignored).

    Args:
        model: the MSA GPT model (or megatron's list of model chunks, one per virtual stage;
            the checkpoint then holds ``model0``, ``model1``, ... as Megatron-LM saves them).
        checkpoint_dir: directory written by ``dist_checkpointing.save``.

    Returns:
        The MSA-only keys that were left at their initial values.

    Raises:
        TypeError: ``model`` is neither a module nor a list of them.
        ValueError: the model was built with ``perform_initialization=False`` (Megatron's
            ``--no-initialization``), which would leave the MSA-only parameters, absent from
            a dense checkpoint, as uninitialised memory (checked before anything is read).
        RuntimeError: the checkpoint already holds MSA index weights (an MSA checkpoint: load
            it as one), holds model tensors the MSA model has no parameter for, or lacks
            parameters it needs (a different model config).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from .attention import _msa_cores, model_chunks

    chunks = model_chunks(model)
    for core in _msa_cores(chunks):  # the layer's config: its index projections' too
        if not getattr(core.config, "perform_initialization", True):
            raise ValueError(
                "the MSA model was built with perform_initialization=False (Megatron's "
                "--no-initialization): its index projections, which a dense checkpoint has "
                "no values for, would keep uninitialised memory; build it with "
                "initialization for the dense -> MSA load")
    skipped: List[str] = []
    sharded = {}
    for i, chunk in enumerate(chunks):
        chunk_sd = chunk.sharded_state_dict()
        fresh = msa_only_keys(chunk_sd)
        skipped.extend(fresh)
        for key in fresh:
            del chunk_sd[key]
        sharded[f"model{i}" if len(chunks) > 1 else "model"] = chunk_sd
    # the checkpoint keys (ShardedTensor.key) under the model's own roots (decoder, embedding,
    # output_layer ...): the rest of a training checkpoint (optimizer, rng state) is not ours
    roots = {str(getattr(item, "key", "")).split(".")[0] for item in nested_values(sharded)}
    # RETURN_ALL: requested keys the checkpoint lacks are dropped from the request (reported
    # below by load_state_dict); checkpoint keys nobody requested come back as `unread`
    loaded, unread, _ = dist_checkpointing.load(sharded, checkpoint_dir,
                                                strict=StrictHandling.RETURN_ALL)
    unread = sorted(key for key in unread
                    if key.split(".")[0] in roots and not key.endswith("_extra_state"))
    index = msa_only_keys(unread)
    if index:
        raise RuntimeError(
            f"{checkpoint_dir} already holds MSA index weights ({_listed(index)}): it is an MSA "
            "checkpoint; load it as one (Megatron's --load, dist_checkpointing.load), not "
            "as a dense checkpoint, which would re-initialise the trained index branch")
    if unread:
        raise RuntimeError(
            f"dense checkpoint does not match the MSA model: it holds {_listed(unread)}, which "
            "the model has no parameter for (a different model config, e.g. qk_layernorm or "
            "biases); they would be dropped")
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


def _listed(keys: List[str], most: int = 6) -> str:
    shown = ", ".join(keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")
