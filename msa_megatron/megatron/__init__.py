"""megatron-core integration of MSA: layer spec, attention modules, KL loss plumbing, metrics.

Entry points: :func:`get_gpt_layer_msa_spec` (or ``--spec msa_megatron.megatron.spec
gpt_layer_msa_spec`` in Megatron-LM), :func:`set_msa_mode` / :func:`apply_msa_warmup`,
:func:`set_kl_loss_scale` with :func:`schedule_loss_scale` (megatron-core 0.16; 0.19's schedule
sets it), :func:`get_msa_metrics`, and :func:`reduce_index_grads_over_tp` for training loops
without megatron-core's ``finalize_model_grads`` (which sums the replicated index parameters'
gradients over TP itself).
"""

from .attention import (
    MSACoreAttention,
    MSASelfAttention,
    MSASelfAttentionSubmodules,
    apply_msa_warmup,
    clear_selection_cache,
    index_branch_parameters,
    set_msa_mode,
)
from .args import add_msa_arguments, msa_config_from_args
from .checkpoint import load_dense_checkpoint, msa_only_keys
from .index import MSAIndexBranch, reduce_index_grads_over_tp
from .loss import get_kl_loss_scale, schedule_loss_scale, set_kl_loss_scale
from .metrics import get_msa_metrics
from .probe import SelectionProbe, arm_selection_probe
from .spec import MSALayerSpec, get_gpt_layer_msa_spec, gpt_layer_msa_spec

__all__ = [
    "MSACoreAttention",
    "MSAIndexBranch",
    "MSALayerSpec",
    "MSASelfAttention",
    "MSASelfAttentionSubmodules",
    "SelectionProbe",
    "add_msa_arguments",
    "apply_msa_warmup",
    "arm_selection_probe",
    "clear_selection_cache",
    "get_gpt_layer_msa_spec",
    "get_kl_loss_scale",
    "get_msa_metrics",
    "gpt_layer_msa_spec",
    "index_branch_parameters",
    "load_dense_checkpoint",
    "msa_config_from_args",
    "msa_only_keys",
    "reduce_index_grads_over_tp",
    "schedule_loss_scale",
    "set_kl_loss_scale",
    "set_msa_mode",
]
