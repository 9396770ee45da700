"""The Megatron-LM launch kit stays consistent with MSAConfig, with patches/ and with itself.

``examples/megatron_lm/msa_gpt_setup.py`` holds the kit's argument logic without importing
``megatron.training`` (megatron-core >= 0.17, Python >= 3.12), so it is tested here on any
Python: MSA flags, the warmup switch, the adaptation to missing Transformer Engine / Apex, the
learning-rate schedule fit, the shell defaults of ``msa_gpt_args.sh`` for any ``TRAIN_ITERS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from msa_megatron import MSAConfig
from msa_megatron.megatron.args import MSA_FLAG_FIELDS, add_msa_arguments, msa_config_from_args

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "examples" / "megatron_lm"
ARGS_SCRIPT = KIT / "msa_gpt_args.sh"
ARGUMENTS_PATCH = REPO / "patches" / "0001-msa-arguments.patch"

sys.path.insert(0, str(KIT))
import msa_gpt_setup as setup  # noqa: E402

NO_KERNELS = dict.fromkeys(("transformer_engine", "apex", "fused_weight_gradient_mlp_cuda",
                            "scaled_masked_softmax_cuda"), False)
ALL_KERNELS = dict.fromkeys(NO_KERNELS, True)


@pytest.fixture()
def parser() -> argparse.ArgumentParser:
    return setup.add_msa_args(argparse.ArgumentParser())


def _flags(parser: argparse.ArgumentParser) -> set:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--msa")}


def test_defaults_are_msa_config_defaults(parser):
    assert setup.msa_config_from_args(parser.parse_args([])) == MSAConfig()
    warm = setup.msa_config_from_args(parser.parse_args(["--msa-warmup-steps", "10"]))
    assert warm == dataclasses.replace(MSAConfig(), mode="dense")


def test_flags_reach_the_config(parser):
    args = parser.parse_args([
        "--msa-block-size", "64", "--msa-top-k", "8", "--msa-init-blocks", "1",
        "--msa-local-blocks", "2", "--msa-index-heads", "4", "--msa-index-key-heads", "2",
        "--msa-index-head-dim", "64", "--msa-kl-coeff", "0.25", "--msa-backend", "torch",
        "--msa-cp-kv-exchange", "selective"])
    assert setup.msa_config_from_args(args) == MSAConfig(
        block_size=64, top_k=8, init_blocks=1, local_blocks=2, index_heads=4, index_key_heads=2,
        index_head_dim=64, kl_coeff=0.25, backend="torch", cp_kv_exchange="selective")
    with pytest.raises(ValueError, match="top_k"):
        setup.msa_config_from_args(parser.parse_args(["--msa-top-k", "0"]))


def test_unset_patched_flags_keep_msa_config_defaults():
    """The patched parser leaves unset flags at None: MSAConfig's defaults apply."""
    args = argparse.Namespace(**{f"msa_{name}": None for name in setup.MSA_CONFIG_FLAGS},
                              msa_warmup_steps=3)
    assert setup.msa_config_from_args(args) == dataclasses.replace(MSAConfig(), mode="dense")


def test_warmup_switch():
    assert [setup.msa_mode_at(i, 2) for i in range(4)] == ["dense", "dense", "sparse", "sparse"]
    assert setup.msa_mode_at(0, 0) == "sparse"


def test_flags_are_the_library_flags(parser):
    """The kit adds the library's --msa-* flags (and its own --dense-gpt), no copy of them."""
    library = add_msa_arguments(argparse.ArgumentParser())
    assert _flags(parser) == _flags(library)
    assert setup.msa_config_from_args is msa_config_from_args
    assert set(setup.MSA_CONFIG_FLAGS) == set(MSA_FLAG_FIELDS)
    assert parser.parse_args(["--dense-gpt"]).dense_gpt
    assert not parser.parse_args([]).dense_gpt


def test_patch_takes_its_flags_from_the_library():
    text = ARGUMENTS_PATCH.read_text()
    assert "add_msa_arguments(parser)" in text
    assert not re.findall(r"^\+.*add_argument\('(--msa-[a-z-]+)'", text, flags=re.MULTILINE)


def test_no_duplicate_flags_on_a_patched_parser():
    """A parser that already has the --msa-* flags (patched megatron.training) gets only the
    kit's own --dense-gpt: argparse would raise on a second --msa-top-k."""
    patched = argparse.ArgumentParser()
    patched.add_argument("--msa", action="store_true")
    for flag in _flags(setup.add_msa_args(argparse.ArgumentParser())):
        patched.add_argument(flag)
    assert setup.parser_has_msa_flags(patched)
    setup.add_msa_args(patched)  # no argparse.ArgumentError
    assert patched.parse_args(["--dense-gpt"]).dense_gpt


def test_warmup_flag_added_once_and_default_zero(parser):
    assert [s for a in parser._actions for s in a.option_strings].count("--msa-warmup-steps") == 1
    assert parser.parse_args([]).msa_warmup_steps == 0
    assert not setup.parser_has_msa_flags(argparse.ArgumentParser())


def _megatron_args(**overrides) -> argparse.Namespace:
    values = dict(transformer_impl="transformer_engine", gradient_accumulation_fusion=True,
                  no_persist_layer_norm=False, apply_rope_fusion=True, masked_softmax_fusion=True,
                  sequence_parallel=True, tensor_model_parallel_size=2, normalization="RMSNorm",
                  use_distributed_optimizer=True, save="/ckpt", load="/ckpt")
    values.update(overrides)
    return argparse.Namespace(**values)


def test_adapts_without_te_and_apex():
    args = _megatron_args()
    off = setup.adapt_to_installed_kernels(args, [], NO_KERNELS)
    assert args.transformer_impl == "local"
    assert not args.gradient_accumulation_fusion and args.no_persist_layer_norm
    assert not args.apply_rope_fusion and not args.masked_softmax_fusion
    assert not args.sequence_parallel
    assert not args.use_distributed_optimizer  # torch Adam: megatron cannot resume it
    assert len(off) == 7
    line = setup.notice(NO_KERNELS, off)
    assert "\n" not in line and "Transformer Engine, Apex not installed" in line
    assert "gradient accumulation fusion" in line and "sequence parallel" in line


def test_keeps_everything_with_te_and_apex():
    args = _megatron_args()
    assert setup.adapt_to_installed_kernels(args, [], ALL_KERNELS) == []
    assert args == _megatron_args()


def test_apex_without_te_keeps_apex_features():
    """Local layers with Apex: its gradient accumulation fusion and LayerNorm stay on (RMSNorm
    still uses torch norms, so sequence parallelism goes)."""
    kernels = dict(ALL_KERNELS, transformer_engine=False)
    args = _megatron_args(normalization="LayerNorm")
    off = setup.adapt_to_installed_kernels(args, [], kernels)
    assert args.gradient_accumulation_fusion and not args.no_persist_layer_norm
    assert args.sequence_parallel and not args.apply_rope_fusion
    assert off == ["Transformer Engine layers (--transformer-impl local)", "RoPE fusion"]
    rms = _megatron_args()
    setup.adapt_to_installed_kernels(rms, [], kernels)
    assert not rms.sequence_parallel


def test_distributed_optimizer_kept_without_checkpoints():
    args = _megatron_args(save=None, load=None)
    off = setup.adapt_to_installed_kernels(args, [], NO_KERNELS)
    assert args.use_distributed_optimizer and len(off) == 6


def test_explicit_te_without_te_is_an_error():
    args = _megatron_args()
    with pytest.raises(ValueError, match="transformer_engine"):
        setup.adapt_to_installed_kernels(args, ["--transformer-impl", "transformer_engine"],
                                         NO_KERNELS)
    with pytest.raises(ValueError, match="transformer_engine"):
        setup.adapt_to_installed_kernels(args, ["--transformer-impl=transformer_engine"],
                                         NO_KERNELS)


@pytest.mark.parametrize("train_iters", [1, 2, 6, 10, 11, 199, 10000])
@pytest.mark.parametrize("warmup", [0, 1, 200, 50000])
def test_lr_schedule_fits_any_train_iters(train_iters, warmup):
    args = argparse.Namespace(train_iters=train_iters, lr_decay_iters=None, lr_warmup_iters=warmup)
    changed = setup.fit_lr_schedule(args)
    assert 0 <= args.lr_warmup_iters < train_iters  # OptimizerParamScheduler's assert
    assert bool(changed) == (warmup >= train_iters)
    if warmup < train_iters:
        assert args.lr_warmup_iters == warmup


def test_attended_block_fraction():
    assert setup.attended_block_fraction(256, 32, 2) == pytest.approx(15 / 36)  # 8 blocks
    assert setup.attended_block_fraction(256, 32, 8) == 1.0
    assert setup.attended_block_fraction(100, 32, 1) == pytest.approx(100 / (32 + 64 + 96 + 4 * 4))
    with pytest.raises(ValueError, match="top_k"):
        setup.attended_block_fraction(256, 32, 0)


def _shell_args(env: dict) -> list:
    script = f'source "{ARGS_SCRIPT}"; printf "%s\\n" "${{MSA_GPT_ARGS[@]}}"'
    proc = subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, check=True)
    return proc.stdout.split("\n")


def _value(args: list, flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("realpath") is None,
                    reason="bash / realpath not installed")
@pytest.mark.parametrize("train_iters", [1, 6, 10000])
def test_shell_defaults_valid_for_any_train_iters(train_iters, tmp_path):
    args = _shell_args({"TRAIN_ITERS": str(train_iters), "OUT_DIR": "rel/out"})
    warmup, decay = int(_value(args, "--lr-warmup-iters")), int(_value(args, "--lr-decay-iters"))
    assert 0 <= warmup < decay == train_iters and warmup <= 200
    assert Path(_value(args, "--save")).is_absolute() and _value(args, "--save").endswith(
        "rel/out/checkpoints")
    assert _value(args, "--load") == _value(args, "--save")  # re-running resumes
    assert "--mock-data" in args and "--transformer-impl" not in args
    assert "--sequence-parallel" in args  # TP=2 default; the entry point drops it with torch norms


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("realpath") is None,
                    reason="bash / realpath not installed")
def test_shell_data_and_tokenizer_match_prepare_data(tmp_path):
    args = _shell_args({"DATA_PATH": str(tmp_path / "corpus"), "CHECKPOINTS": "0",
                        "MSA_BACKEND": "torch", "TRANSFORMER_IMPL": "local"})
    text = " ".join(args)
    sys.path.insert(0, str(KIT))
    import prepare_data

    assert prepare_data.TOKENIZER_FLAGS in text
    assert "--save" not in args and "--load" not in args
    assert _value(args, "--msa-backend") == "torch"
    assert _value(args, "--transformer-impl") == "local"


def test_launch_scripts_use_known_msa_flags(parser):
    used = set(re.findall(r"(--msa-[a-z-]+)", ARGS_SCRIPT.read_text()))
    assert used and used <= _flags(parser)


def test_every_launcher_saves_loads_and_picks_the_entry():
    """The three launchers take their flags (incl. --save/--load) from msa_gpt_args.sh."""
    for name in ("train_single_node.sh", "train_multi_node.sh", "train_slurm.sbatch"):
        text = (KIT / name).read_text()
        assert 'source "$HERE/msa_gpt_args.sh"' in text, name
        assert '"${MSA_GPT_ARGS[@]}"' in text and "${ENTRY:-pretrain_msa_gpt.py}" in text, name
