#!/usr/bin/env bash
# Set up a virtual environment from a fresh clone and run examples/pretrain_tiny.py with torchrun.
#
#   bash examples/run_tiny.sh                      # TP=2 x CP=2 on 4 CPU processes, < 20 min
#   TP=2 CP=1 bash examples/run_tiny.sh --steps 60  # other layouts; extra flags go to the script
#   DEVICE=cuda NPROC=8 TP=2 CP=2 bash examples/run_tiny.sh   # GPUs: data parallel = NPROC/(TP*CP)
#
# Environment: VENV (default .venv-example), TORCH_SPEC (default torch==2.13.0; installed first
# so that the package install keeps it), TP, CP, NPROC (default TP*CP), DEVICE (cpu | cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-example}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TP=${TP:-2}
CP=${CP:-2}
NPROC=${NPROC:-$((TP * CP))}
DEVICE=${DEVICE:-cpu}

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e '.[examples,test]'

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    examples/pretrain_tiny.py --tp "$TP" --cp "$CP" --device "$DEVICE" "$@"
