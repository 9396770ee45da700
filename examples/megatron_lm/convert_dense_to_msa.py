"""Convert a dense GPT checkpoint of Megatron's training loop into an MSA model's checkpoint.

The paper's continued-pretraining path, from the command line:

1. train (or take) a dense GPT, saved by Megatron in its distributed format (``torch_dist``),
   e.g. ``pretrain_msa_gpt.py --dense-gpt --save DENSE``;
2. ``convert_dense_to_msa.py <the same model flags and --msa-* flags> --dense-load DENSE
   --save MSA``: builds the MSA model, loads every dense weight into it
   (:func:`msa_megatron.megatron.load_dense_checkpoint`; the index projections and index norms
   keep their fresh initialisation) and saves it with Megatron's ``save_checkpoint`` (model only,
   at the dense checkpoint's iteration);
3. continue training with MSA: ``pretrain_msa_gpt.py ... --load MSA --finetune`` (model weights
   only, optimizer and iteration counter fresh, so ``--msa-warmup-steps`` counts from 0: dense
   warmup of the index branch, then sparse).

Runs under ``torchrun`` with any parallel layout (dist checkpoints reshard); the flags are those
of ``pretrain_msa_gpt.py`` (``msa_gpt_args.sh`` builds them: ``train_single_node.sh`` runs this
script when ``ENTRY=convert_dense_to_msa.py``) plus ``--dense-load``. Needs megatron-core 0.19.x.
"""

from __future__ import annotations

import argparse
import os

import torch


from msa_gpt_setup import require_megatron_training  # noqa: E402

require_megatron_training(__file__)

from megatron.core.enums import ModelType
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import unwrap_model
from megatron.training import get_args, print_rank_0
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.checkpointing import save_checkpoint
from megatron.training.initialize import initialize_megatron
from megatron.training.training import setup_model_and_optimizer

from msa_gpt_setup import add_msa_args
from msa_megatron.megatron import load_dense_checkpoint
from pretrain_msa_gpt import msa_model_config, parse_msa_gpt_args

TRACKER = "latest_checkpointed_iteration.txt"


def add_convert_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The MSA flags plus ``--dense-load`` (the dense checkpoint directory)."""
    parser = add_msa_args(parser)
    group = parser.add_argument_group(title="dense -> MSA conversion")
    group.add_argument("--dense-load", required=True,
                       help="dense checkpoint: Megatron's save directory (with " + TRACKER +
                            ") or one iter_NNNNNNN directory")
    return parser


def dense_checkpoint_dir(path: str) -> tuple:
    """``(iteration directory, iteration)`` of a Megatron save directory or iteration directory.

    Raises:
        FileNotFoundError: no checkpoint there.
        ValueError: a tracker file that holds neither an iteration number nor ``release``.
    """
    path = os.path.abspath(path)
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as handle:
            text = handle.read().strip()
        if text != "release" and not text.isdigit():
            raise ValueError(f"--dense-load: {tracker} must hold an iteration number or "
                             f"'release', got {text[:80]!r}")
        iteration = 0 if text == "release" else int(text)
        name = "release" if text == "release" else f"iter_{iteration:07d}"
        path = os.path.join(path, name)
    else:
        base = os.path.basename(path.rstrip("/"))
        iteration = int(base[5:]) if base.startswith("iter_") and base[5:].isdigit() else 0
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"--dense-load: no distributed checkpoint in {path} (expected "
                                f"{TRACKER} or an iter_NNNNNNN directory in torch_dist format)")
    return path, iteration


def main() -> None:
    args = parse_msa_gpt_args(add_convert_args)
    if args.dense_gpt:
        raise SystemExit("convert_dense_to_msa.py builds the MSA model: drop --dense-gpt")
    if not args.save:
        raise SystemExit("convert_dense_to_msa.py needs --save (where the MSA checkpoint goes)")
    if args.load:
        print_rank_0(f"convert_dense_to_msa.py: ignoring --load {args.load} (reads --dense-load)")
        args.load = None
    args.skip_train = True  # model only: no optimizer, no DDP wrapper
    args.no_save_optim = True
    args.no_save_rng = True
    source, iteration = dense_checkpoint_dir(args.dense_load)

    initialize_megatron()
    args = get_args()
    model, _, _ = setup_model_and_optimizer(
        ModelType.encoder_or_decoder,
        cfg_container=pretrain_cfg_container_from_args(args, msa_model_config(args)),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    fresh = load_dense_checkpoint(unwrap_model(model), source)
    print_rank_0(f"loaded dense checkpoint {source} (iteration {iteration}); "
                 f"{len(fresh)} MSA-only tensors keep their initialisation: "
                 f"{sorted(set(k.split('.')[-2] for k in fresh))}")
    save_checkpoint(iteration, model, None, None, num_floating_point_operations_so_far=0)
    torch.distributed.barrier()
    print_rank_0(f"saved the MSA model to {args.save} (iteration {iteration}); continue with "
                 f"pretrain_msa_gpt.py ... --load {args.save} --finetune")


if __name__ == "__main__":
    main()
