#!/usr/bin/env bash
# Set up a virtual environment from a fresh clone and run examples/pretrain_tiny.py with torchrun.
#
#   bash examples/run_tiny.sh                      # TP=2 x CP=2 on 4 CPU processes, < 20 min
#   TP=2 CP=1 bash examples/run_tiny.sh --steps 60  # other layouts; extra flags go to the script
#   DEVICE=cuda NPROC=8 TP=2 CP=2 bash examples/run_tiny.sh   # GPUs: data parallel = NPROC/(TP*CP)
#   bash examples/run_tiny.sh --help               # this text and the script's options
#   bash examples/run_tiny.sh --check-only [flags] # check the settings, install and launch nothing
#
# --help and --check-only install nothing and start no torchrun. They use the first of
# $VENV/bin/python and $PYTHON (default python3) that imports torch and megatron-core; without
# one, --help prints only this text and --check-only checks only TP, CP, NPROC and DEVICE (and
# says so); a PYTHON that is set but cannot import both is an error. A run always uses $VENV
# (PYTHON is for these two only). Flags other than these two go to pretrain_tiny.py, never to
# torchrun.
#
# Environment: VENV (default .venv-example), TORCH_SPEC (default torch==2.13.0; installed first
# so that the package install keeps it. On Linux x86_64, PyPI's torch wheel is the CUDA build
# (nvidia-* wheels, several GB) whether or not the machine has a GPU; for the CPU build pass pip
# options too: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"),
# TP, CP (CP is 1, 2, 4 or 8), NPROC (default TP*CP, a multiple of TP*CP), DEVICE (cpu | cuda).
# Every setting is checked (one message, non-zero exit) before any process starts.
set -euo pipefail
cd "$(dirname "$0")/.."
SELF=examples/run_tiny.sh

VENV=${VENV:-.venv-example}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TP=${TP:-2}
CP=${CP:-2}
DEVICE=${DEVICE:-cpu}

# What to do: --help wins over --check-only; both are taken out of the script's flags.
MODE=run
ARGS=()
for arg in "$@"; do
    case $arg in
        -h|--help) MODE=help ;;
        --check-only) [ "$MODE" = help ] || MODE=check ;;
        *) ARGS+=("$arg") ;;
    esac
done

# A PYTHON the user names must work: with a typo, --check-only would skip the script's flags.
if [ "$MODE" != run ] && [ -n "${PYTHON:-}" ] && ! { command -v "$PYTHON" >/dev/null 2>&1 \
        && "$PYTHON" -c 'import torch, megatron.core' >/dev/null 2>&1; }; then
    echo "$SELF: PYTHON=$PYTHON cannot import torch and megatron-core (is it the path of a" \
         "Python with both installed?)" >&2
    exit 2
fi

# An interpreter that can run pretrain_tiny.py without installing anything (empty: none).
ready_python() {
    local py
    for py in "$VENV/bin/python" "${PYTHON:-python3}"; do
        if command -v "$py" >/dev/null 2>&1 \
                && "$py" -c 'import torch, megatron.core' >/dev/null 2>&1; then
            echo "$py"
            return 0
        fi
    done
    return 0
}

if [ "$MODE" = help ]; then
    sed -n '2,/^set -euo pipefail$/p' "$SELF" | sed -e '$d' -e 's/^# \{0,1\}//'
    py=$(ready_python)
    if [ -n "$py" ]; then
        echo
        echo "Options of examples/pretrain_tiny.py ($py):"
        exec "$py" examples/pretrain_tiny.py --help
    fi
    echo
    echo "(pretrain_tiny.py's own options are listed once $VENV is set up, by a run without" \
         "--help, or by any Python with torch and megatron-core: PYTHON=/path/to/python)"
    exit 0
fi

for name in TP CP; do
    case ${!name} in
        ''|*[!0-9]*|0*) echo "$SELF: $name=${!name} must be a positive integer" >&2; exit 2 ;;
    esac
done
case $CP in
    1|2|4|8) ;;
    *) echo "$SELF: CP=$CP must be 1, 2, 4 or 8 (documents are padded to 16 tokens and split" \
            "into 2 x CP chunks)" >&2; exit 2 ;;
esac
NPROC=${NPROC:-$((TP * CP))}
case $NPROC in
    ''|*[!0-9]*|0*) echo "$SELF: NPROC=$NPROC must be a positive integer" >&2; exit 2 ;;
esac
if [ $((NPROC % (TP * CP))) -ne 0 ]; then
    echo "$SELF: NPROC=$NPROC must be a multiple of TP x CP = $TP x $CP = $((TP * CP))" >&2
    exit 2
fi
case $DEVICE in
    cpu|cuda) ;;
    *) echo "$SELF: DEVICE=$DEVICE must be cpu or cuda" >&2; exit 2 ;;
esac
if [ "$DEVICE" = cuda ]; then  # before any install: the CUDA torch build is several GB
    # shellcheck source=gpu_count.sh
    source examples/gpu_count.sh   # msa_count_gpus, the Megatron-LM launchers' count too
    msa_count_gpus
    if [ "${MSA_GPUS_LISTED:-0}" -eq 0 ]; then
        echo "$SELF: DEVICE=cuda but nvidia-smi lists no NVIDIA GPU; use DEVICE=cpu" >&2
        exit 2
    fi
    if [ "$MSA_GPUS" -eq 0 ]; then
        echo "$SELF: DEVICE=cuda but no GPU is visible" \
             "(CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES'); use DEVICE=cpu" >&2
        exit 2
    fi
fi

# Layout and sizes are checked in one process, before torchrun starts any.
check() {
    WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC "$1" examples/pretrain_tiny.py \
        --tp "$TP" --cp "$CP" --device "$DEVICE" ${ARGS[@]+"${ARGS[@]}"} --check-only
}

if [ "$MODE" = check ]; then
    py=$(ready_python)
    if [ -z "$py" ]; then
        echo "$SELF: TP=$TP CP=$CP NPROC=$NPROC DEVICE=$DEVICE OK; pretrain_tiny.py's flags" \
             "were not checked: no Python with torch and megatron-core ($VENV is not set up;" \
             "set PYTHON=/path/to/python, or run without --check-only to install)"
        exit 0
    fi
    check "$py"
    exit $?
fi

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC2086  # TORCH_SPEC may carry pip options (--index-url ...)
"$VENV/bin/python" -m pip install -q $TORCH_SPEC
"$VENV/bin/python" -m pip install -q -e '.[examples,test]'

check "$VENV/bin/python"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    examples/pretrain_tiny.py --tp "$TP" --cp "$CP" --device "$DEVICE" ${ARGS[@]+"${ARGS[@]}"}
