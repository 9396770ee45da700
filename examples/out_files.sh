# The one rule on how many files a device call may leave in its $OUT, sourced by
# examples/run_retrieval.sh (PACK=1) and benchmarks/gpu_retrieval_chain.sh (bash; safe under
# `set -euo pipefail`). The device tool returns at most MSA_OUT_MAX_FILES files from $OUT and
# leaves the others out.
MSA_OUT_MAX_FILES=8

# msa_out_files DIR: prints how many files lie under DIR (sub-folders included; 0 when DIR
# does not exist).
msa_out_files() {
    if [ -d "$1" ]; then find "$1" -type f | wc -l; else echo 0; fi
}

# msa_warn_out_files SCRIPT DIR: one warning on stderr, naming SCRIPT, when DIR holds more files
# than the device tool returns; always returns 0.
msa_warn_out_files() {
    local count
    count=$(msa_out_files "$2")
    if [ "$count" -gt "$MSA_OUT_MAX_FILES" ]; then
        echo "$1: WARNING: $count files under $2: the device tool returns at most" \
             "$MSA_OUT_MAX_FILES (the others are left out)" >&2
    fi
    return 0
}
