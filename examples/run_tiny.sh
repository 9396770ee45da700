#!/usr/bin/env bash
# Set up a virtual environment from a fresh clone and run examples/pretrain_tiny.py with torchrun.
#
#   bash examples/run_tiny.sh                      # TP=2 x CP=2 on 4 CPU processes, < 20 min
#   TP=2 CP=1 bash examples/run_tiny.sh --steps 60  # other layouts; extra flags go to the script
#   DEVICE=cuda NPROC=8 TP=2 CP=2 bash examples/run_tiny.sh   # GPUs: data parallel = NPROC/(TP*CP)
#   bash examples/run_tiny.sh --help               # the script's options and their defaults
#
# Environment: VENV (default .venv-example), TORCH_SPEC (default torch==2.13.0; installed first
# so that the package install keeps it; on a machine with CUDA that is PyPI's CUDA build (several
# GB); pip options may follow, e.g. for the CPU build
# TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"), TP, CP (CP is
# 1, 2, 4 or 8), NPROC (default TP*CP, a multiple of TP*CP), DEVICE (cpu | cuda).
# Every setting is checked (one message, non-zero exit) before any process starts.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-example}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TP=${TP:-2}
CP=${CP:-2}
DEVICE=${DEVICE:-cpu}
for name in TP CP; do
    case ${!name} in
        ''|*[!0-9]*) echo "run_tiny.sh: $name=${!name} must be a positive integer" >&2; exit 2 ;;
    esac
done
NPROC=${NPROC:-$((TP * CP))}
case $NPROC in
    ''|*[!0-9]*) echo "run_tiny.sh: NPROC=$NPROC must be a positive integer" >&2; exit 2 ;;
esac
case $DEVICE in
    cpu|cuda) ;;
    *) echo "run_tiny.sh: DEVICE=$DEVICE must be cpu or cuda" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC2086  # TORCH_SPEC may carry pip options (--index-url ...)
"$VENV/bin/python" -m pip install -q $TORCH_SPEC
"$VENV/bin/python" -m pip install -q -e '.[examples,test]'

for arg in "$@"; do
    case $arg in
        -h|--help) exec "$VENV/bin/python" examples/pretrain_tiny.py --help ;;
    esac
done
# Layout and sizes are checked in one process, before torchrun starts any.
WORLD_SIZE=$NPROC LOCAL_WORLD_SIZE=$NPROC "$VENV/bin/python" examples/pretrain_tiny.py \
    --tp "$TP" --cp "$CP" --device "$DEVICE" "$@" --check-only

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    examples/pretrain_tiny.py --tp "$TP" --cp "$CP" --device "$DEVICE" "$@"
