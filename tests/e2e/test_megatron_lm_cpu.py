"""The Megatron-LM launch kit end to end through megatron.training, on 2 CPU processes.

``train_single_node.sh`` -> ``pretrain_msa_gpt.py`` -> ``megatron.training.pretrain`` of the
megatron-core 0.19.2 wheel, with CUDA stood in for by ``tests/e2e/megatron_cpu_runner.py`` (a
``torchrun`` stand-in on ``PATH`` inserts it) and gloo: TP=2, byte-level data from
``prepare_data.py``, save / stop / resume across the dense -> sparse switch (the resumed loss equals
the uninterrupted run's), and dense GPT -> ``convert_dense_to_msa.py`` -> MSA continued training.

The wheel is the one ``tests/e2e/test_patches.py`` uses (cached or downloaded). It needs Python
>= 3.12; on 3.11 the test adds ``typing.override`` (the only 3.12 API megatron.training imports)
and the installed megatron-core's compiled dataset helpers. It skips, saying why, when that is
not possible (offline, no helpers for this Python).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.e2e.test_patches import BASE_VERSION, base_wheel  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "examples" / "megatron_lm"
RUNNER = REPO / "tests" / "e2e" / "megatron_cpu_runner.py"
TIMEOUT_S = 600

SHIM = '''import typing
if not hasattr(typing, "override"):
    import typing_extensions
    typing.override = typing_extensions.override
'''

TORCHRUN = f'''#!/usr/bin/env bash
# torchrun stand-in: the fake-CUDA runner before the script, gloo after its arguments.
args=(); seen=0
for a in "$@"; do
    if [ $seen = 0 ] && [[ "$a" == *.py ]]; then args+=("{RUNNER}" "$a"); seen=1
    else args+=("$a"); fi
done
exec "{sys.executable}" -m torch.distributed.run "${{args[@]}}" --distributed-backend gloo
'''


@pytest.fixture(scope="module")
def env(base_wheel, tmp_path_factory) -> dict:  # noqa: F811
    root = tmp_path_factory.mktemp("mcore019")
    site = root / "site"
    with zipfile.ZipFile(base_wheel) as wheel:
        wheel.extractall(site, [m for m in wheel.namelist() if m.startswith("megatron/")])
    if sys.version_info < (3, 12):
        if importlib.util.find_spec("typing_extensions") is None:
            pytest.skip("megatron.training needs typing.override (Python 3.12 or typing_extensions)")
        (site / "sitecustomize.py").write_text(SHIM)
    helpers = "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX")
    datasets = site / "megatron" / "core" / "datasets"
    if not (datasets / helpers).exists():
        installed = importlib.util.find_spec("megatron.core.datasets.helpers_cpp")
        if installed is None or not installed.origin.endswith(helpers):
            pytest.skip(f"no compiled megatron dataset helpers for this Python ({helpers})")
        shutil.copy(installed.origin, datasets / helpers)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(TORCHRUN)
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IEXEC)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MSA_", "TORCH"))}
    environ.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), OMP_NUM_THREADS="1",
        # a tiny model, fp32 (megatron's bf16 optimizers assert CUDA tensor types)
        TP="2", CP="1", SEQ_LEN="256", NUM_LAYERS="2", HIDDEN="64", FFN_HIDDEN="128",
        HEADS="4", QUERY_GROUPS="2", MICRO_BATCH="1", GLOBAL_BATCH="2", MSA_BLOCK_SIZE="32",
        MSA_TOP_K="2", MSA_INDEX_HEAD_DIM="16", PRECISION="", DIST_OPTIMIZER="0",
        MSA_BACKEND="torch", LOG_INTERVAL="1", EVAL_ITERS="1", GPUS_PER_NODE="2",
    )
    check = subprocess.run([sys.executable, "-c", "import megatron.training, megatron.core as m; "
                            "print(m.__version__)"], env=environ, capture_output=True, text=True)
    if check.returncode != 0 or check.stdout.strip() != BASE_VERSION:
        pytest.skip(f"megatron.training {BASE_VERSION} does not import here: "
                    f"{check.stderr.strip()[-300:]}")
    data = root / "data" / "corpus"
    subprocess.run([sys.executable, str(KIT / "prepare_data.py"), "--output-prefix", str(data),
                    "--max-files", "40"], env=environ, check=True, capture_output=True)
    environ["DATA_PATH"] = str(data)
    environ["SITE"] = str(site)
    return environ


def _train(env: dict, log: Path, *extra: str, **overrides: str) -> str:
    proc = subprocess.run(["bash", str(KIT / "train_single_node.sh"), *extra],
                          env={**env, **overrides}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _losses(text: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration +(\d+)/ *\d+ \|.*?lm loss: ([0-9.E+-]+)", text)}


def test_train_stop_resume_across_the_switch(env, tmp_path):
    common = dict(TRAIN_ITERS="4", MSA_WARMUP_STEPS="3")
    straight = _train(env, tmp_path / "straight.log", OUT_DIR=str(tmp_path / "straight"),
                      **common)
    assert "msa-megatron: turned off" in straight and "sequence parallel" in straight
    first = _train(env, tmp_path / "first.log", "--exit-interval", "2",
                   OUT_DIR=str(tmp_path / "run"), **common)
    assert (tmp_path / "run" / "checkpoints" / "latest_checkpointed_iteration.txt"
            ).read_text().strip() == "2"
    assert sorted(_losses(first)) == [1, 2]
    resumed = _train(env, tmp_path / "resumed.log", OUT_DIR=str(tmp_path / "run"), **common)
    assert "successfully loaded checkpoint" in resumed
    assert "MSA attention mode: dense (iteration 3)" in resumed  # iteration 3 of 4: warmup 3
    assert "MSA attention mode: sparse (iteration 4)" in resumed
    assert "msa kl layer_02" in resumed and "msa blocks" in resumed
    # the MSA metrics line of each logged iteration (LOG_INTERVAL=1): recall measured on it,
    # throughput with the MSA layers counted sparse; no MSA keys in Megatron's own line
    msa_lines = re.findall(r"^msa-megatron \| iteration +(\d+) \|(.*)$", resumed, re.MULTILINE)
    assert [int(i) for i, _ in msa_lines] == [3, 4], msa_lines
    assert all("msa recall layer_02: " in line and "MSA counted sparse (TFLOP/s/GPU)" in line
               for _, line in msa_lines), msa_lines
    assert not re.search(r"iteration +\d+/.*msa kl", resumed)
    losses, reference = {**_losses(first), **_losses(resumed)}, _losses(straight)
    assert sorted(losses) == [1, 2, 3, 4]
    # The first resumed iteration continues the run exactly. (Megatron's log after the first
    # iteration of a process averages two iterations, so iteration 4 is not compared.)
    for iteration in (1, 2, 3):
        assert losses[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration


def test_dense_convert_and_continue_with_msa(env, tmp_path):
    dense = _train(env, tmp_path / "dense.log", "--dense-gpt", TRAIN_ITERS="3",
                   CKPT_DIR=str(tmp_path / "dense"))
    assert "msa kl" not in dense
    convert = _train(env, tmp_path / "convert.log", "--dense-load", str(tmp_path / "dense"),
                     ENTRY="convert_dense_to_msa.py", CKPT_DIR=str(tmp_path / "msa"))
    assert "loaded dense checkpoint" in convert and "linear_q_idx" in convert
    msa = _train(env, tmp_path / "msa.log", "--finetune", TRAIN_ITERS="2", MSA_WARMUP_STEPS="1",
                 CKPT_DIR=str(tmp_path / "msa_cont"), LOAD_DIR=str(tmp_path / "msa"))
    assert "successfully loaded checkpoint" in msa
    assert "MSA attention mode: sparse (iteration 2)" in msa
    dense_losses, msa_losses = _losses(dense), _losses(msa)
    # MSA starts from the trained dense weights (closer to the dense end than to its start)
    assert abs(msa_losses[1] - dense_losses[3]) < abs(msa_losses[1] - dense_losses[1])


def test_convert_names_a_bad_tracker_file(env, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("iter_5\n")
    code = (f"import sys; sys.path.insert(0, {str(KIT)!r}); import convert_dense_to_msa as c\n"
            f"c.dense_checkpoint_dir({str(tmp_path)!r})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert "latest_checkpointed_iteration.txt must hold an iteration number" in proc.stderr, \
        proc.stderr[-2000:]


def test_entry_point_on_a_patched_package(env, tmp_path):
    """patches/ applied to megatron.training plus the entry point: no duplicate --msa-* flags,
    the patched loop switches the warmup and logs the KL (once)."""
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    patched = tmp_path / "site"
    shutil.copytree(env["SITE"], patched)
    for patch in sorted((REPO / "patches").glob("*.patch")):
        subprocess.run(["patch", "-p1", "--batch", "--quiet", "-i", str(patch)], cwd=patched,
                       check=True)
    pythonpath = os.pathsep.join([str(patched), str(REPO)])
    text = _train(env, tmp_path / "patched.log", TRAIN_ITERS="2", MSA_WARMUP_STEPS="1",
                  CHECKPOINTS="0", OUT_DIR=str(tmp_path / "out"), PYTHONPATH=pythonpath)
    assert re.search(r"^  msa \.+ True$", text, flags=re.MULTILINE)  # turned on by the entry point
    losses = _losses(text)
    assert sorted(losses) == [1, 2]
    lines = [line for line in text.splitlines() if re.search(r"iteration +\d+/", line)]
    assert all(line.count("msa kl:") == 1 for line in lines), lines
