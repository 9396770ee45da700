# The up-front settings check of examples/run_retrieval.sh and benchmarks/gpu_retrieval_chain.sh
# (bash, sourced from the repository root; safe under `set -euo pipefail`): pretrain_tiny.py
# --check-only with the flags a run will use, which starts nothing, so that a refused setting
# stops a script before it touches its output or trains anything.

# msa_check_settings PYTHON FLAGS...: runs `PYTHON examples/pretrain_tiny.py FLAGS --check-only`;
# returns 0 when pretrain_tiny accepts the flags (printing nothing), else prints its message on
# stderr (warnings left out) and returns 2.
msa_check_settings() {
    local python=$1 message
    shift
    if ! message=$("$python" examples/pretrain_tiny.py "$@" --check-only 2>&1 >/dev/null); then
        printf '%s\n' "$message" | grep -v -i warn >&2 || true
        return 2
    fi
}
