#!/usr/bin/env bash
# GPU integration run of the Megatron-LM path on a fresh 2-GPU machine, one call, < 9 minutes
# (BUDGET seconds from the start, pip install of .whl/ included):
#   a. tests: tests/megatron on CUDA + NCCL, in the background from the start, as parallel pytest
#      units (benchmarks/gpu_tests.py, TEST_JOBS at a time): every test with the torch backend
#      (the parallel layouts), plus the TP / modes / probe / CP / padding / recompute tests with
#      the triton backend; units still running at TESTS_END seconds are interrupted;
#   b. data: the standard library's .py files -> Megatron indexed dataset, byte-level tokenizer;
#   c. train: examples/megatron_lm/train_single_node.sh, TP=2, stops after N iterations (saved);
#   d. resume: the same command again, continues at N+1 up to N+M (across the dense -> sparse
#      switch: the resumed run must start in the mode of iteration N+1);
#   e. convert: dense GPT (--dense-gpt) trained a few iterations, convert_dense_to_msa.py, then MSA
#      continued training from the converted checkpoint (--finetune);
#   f. recipe: the paper's head layout (64 query heads, 4 KV heads, head dim 128) at 64K tokens
#      with CP=2 on 2 GPUs, layers scaled down; tokens/s and peak memory per GPU. Runs alone,
#      after the tests, and only when RECIPE_S seconds are left (else SKIPPED(time)).
# Every step prints PASS/FAIL; the last line is the summary. Logs: $OUT/megatron_lm_logs.tgz
# (versions.txt, one log per step, tests_megatron_cuda.log) and $OUT/summary.txt.
# megatron-core comes from .whl/*.whl (installed into /tmp/site) when present.
# Usage: bash benchmarks/gpu_integration.sh [steps...]   (default: tests data train resume convert recipe)
# Device tool: run(kind="nvidia-h200-x2", carry=[".whl"], command="bash benchmarks/gpu_integration.sh").
set -u
T0=$(date +%s)
BUDGET=${BUDGET:-540}               # seconds for the whole run
TESTS_END=${TESTS_END:-430}         # seconds after the start: running test units are interrupted
TEST_JOBS=${TEST_JOBS:-5}           # pytest units side by side
RECIPE_S=${RECIPE_S:-95}            # the recipe starts only with this many seconds left
OUT=${OUT:-/tmp/out}
RUN=${RUN:-/tmp/msa_integration}    # checkpoints and data (absolute)
LOGS=$RUN/logs
rm -rf "$LOGS"
mkdir -p "$OUT" "$RUN" "$LOGS"
. benchmarks/gpu_env.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$RUN/triton_cache}   # one cache for every process
python3 -c "import sys, torch, triton, megatron.core as mc; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'megatron-core', mc.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" | tee "$LOGS/versions.txt"
python3 -c "import importlib.util as u; print('transformer_engine', bool(u.find_spec('transformer_engine')), 'apex', bool(u.find_spec('apex')))" | tee -a "$LOGS/versions.txt"
steps=${*:-tests data train resume convert recipe}
KIT=examples/megatron_lm
DATA=$RUN/data/stdlib_bytes
declare -A RESULT

has() { [[ " $steps " == *" $1 "* ]]; }
elapsed() { echo $(( $(date +%s) - T0 )); }
mark() {  # mark STEP STATUS
    RESULT[$1]=$2
    echo "=== $1: $2 ($(elapsed) s since start)"
}
# limit S: S seconds, or what is left of the budget (10 s kept for the summary) when less
limit() { local left=$(( BUDGET - 10 - $(elapsed) )); [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
# Small MSA GPT on 2 GPUs (TP=2) for steps c-e: the shapes compile fast and run in seconds.
small() {
    env TP=2 CP=1 SEQ_LEN=4096 NUM_LAYERS=2 HIDDEN=512 FFN_HIDDEN=1408 HEADS=8 QUERY_GROUPS=2 \
        MICRO_BATCH=1 GLOBAL_BATCH=4 MSA_BLOCK_SIZE=128 MSA_TOP_K=8 MSA_INDEX_HEAD_DIM=64 \
        DATA_PATH="$DATA" LOG_INTERVAL=1 EVAL_ITERS=1 EVAL_INTERVAL=1000 SAVE_INTERVAL=1000 \
        GPUS_PER_NODE=2 ${SMALL_ENV:-} "$@"   # SMALL_ENV: overrides for a CPU dry run
}
# loss ITER LOG: the "lm loss" Megatron logged at iteration ITER
loss() { grep -E "iteration +$1/" "$2" | head -n 1 | sed -E 's/.*lm loss: ([0-9.E+-]+).*/\1/'; }

# a. tests/megatron on CUDA (background): parallel pytest units, torch backend for every test,
#    triton backend for the layer tests (kernels themselves: tests/ops)
if has tests; then
    M=tests/megatron
    echo "=== tests: $M on CUDA, $TEST_JOBS units at a time, until $TESTS_END s (background)"
    ( timeout $(( BUDGET - $(elapsed) )) python3 benchmarks/gpu_tests.py \
        "$LOGS/tests_megatron_cuda.log" --jobs "$TEST_JOBS" \
        --deadline-s $(( TESTS_END - $(elapsed) )) \
        --unit "triton=$M/test_megatron_tp.py::test_tp_matches_single_rank $M/test_megatron_modes.py $M/test_megatron_probe.py" \
        --unit "triton=$M/test_megatron_cp_gpt.py::test_gpt_context_parallel_matches_single_rank[cp2] $M/test_megatron_padding.py $M/test_megatron_recompute.py" \
        --backend torch --split test_megatron_checkpoint.py $M/test_megatron_compile.py \
        $M/test_megatron_cp_gpt.py $M/test_megatron_tp.py $M/test_megatron_probe.py \
        $M/test_megatron_padding.py $M > "$LOGS/tests_progress.log" 2>&1
      echo $? > "$RUN/tests.rc" ) &
    TESTS_PID=$!
fi

# b. data
if has data; then
    timeout "$(limit 60)" python3 $KIT/prepare_data.py --output-prefix "$DATA" 2>&1 | tee "$LOGS/data.log" | tail -2
    if [ "${PIPESTATUS[0]}" = 0 ] && [ -s "$DATA.bin" ] && [ -s "$DATA.idx" ]; then mark data PASS; else mark data FAIL; fi
fi

# c. train N=3 of 6 iterations (dense for 2, then sparse), saved at 3 and stopped
N=3; TOTAL=6; WARMUP=2
if has train; then
    rm -rf "$RUN/ckpt"
    small TRAIN_ITERS=$TOTAL MSA_WARMUP_STEPS=$WARMUP CKPT_DIR="$RUN/ckpt" \
        timeout "$(limit 180)" bash $KIT/train_single_node.sh --exit-interval $N > "$LOGS/train.log" 2>&1
    rc=$?
    grep -E "turned off|MSA attention mode|iteration +[0-9]+/|saving checkpoint|peak GPU" "$LOGS/train.log" | cut -c1-400
    if [ "$(cat "$RUN/ckpt/latest_checkpointed_iteration.txt" 2>/dev/null)" = "$N" ] \
        && grep -q "MSA attention mode: sparse (iteration $((WARMUP + 1)))" "$LOGS/train.log" \
        && grep -q "msa kl layer_02" "$LOGS/train.log"; then mark train PASS; else mark train "FAIL(rc=$rc)"; fi
fi

# d. resume: the same command continues at N+1 (sparse, since N >= WARMUP) and ends at TOTAL
if has resume; then
    small TRAIN_ITERS=$TOTAL MSA_WARMUP_STEPS=$WARMUP CKPT_DIR="$RUN/ckpt" \
        timeout "$(limit 150)" bash $KIT/train_single_node.sh > "$LOGS/resume.log" 2>&1
    rc=$?
    grep -E "loaded checkpoint|MSA attention mode|iteration +[0-9]+/|peak GPU" "$LOGS/resume.log" | cut -c1-400
    first=$(grep -oE "iteration +[0-9]+/ +$TOTAL" "$LOGS/resume.log" | head -n 1 | awk '{print $2}' | cut -d/ -f1)
    l_stop=$(loss $N "$LOGS/train.log"); l_first=$(loss 1 "$LOGS/train.log"); l_resume=$(loss $((N + 1)) "$LOGS/resume.log")
    echo "loss: iteration 1 $l_first, iteration $N $l_stop, resumed iteration $((N + 1)) $l_resume"
    # continuing, not restarting: the first resumed loss is closer to iteration N's than to iteration 1's
    cont=$(python3 -c "a,b,c=map(float,'$l_first $l_stop $l_resume'.split()); print(int(abs(c-b) < abs(c-a)))" 2>/dev/null)
    if [ $rc = 0 ] && [ "$first" = $((N + 1)) ] && [ "$cont" = 1 ] \
        && grep -q "MSA attention mode: sparse (iteration $((N + 1)))" "$LOGS/resume.log" \
        && [ "$(cat "$RUN/ckpt/latest_checkpointed_iteration.txt")" = "$TOTAL" ]; then
        mark resume PASS; else mark resume "FAIL(rc=$rc)"; fi
fi

# e. dense GPT -> convert -> MSA continued (dense warmup of the index branch for 1 iteration)
if has convert; then
    rm -rf "$RUN/dense" "$RUN/msa_init" "$RUN/msa_cont"
    small TRAIN_ITERS=4 CKPT_DIR="$RUN/dense" \
        timeout "$(limit 120)" bash $KIT/train_single_node.sh --dense-gpt > "$LOGS/convert_dense.log" 2>&1
    rc1=$?
    small CKPT_DIR="$RUN/msa_init" ENTRY=convert_dense_to_msa.py \
        timeout "$(limit 120)" bash $KIT/train_single_node.sh --dense-load "$RUN/dense" > "$LOGS/convert.log" 2>&1
    rc2=$?
    small TRAIN_ITERS=3 MSA_WARMUP_STEPS=1 CKPT_DIR="$RUN/msa_cont" LOAD_DIR="$RUN/msa_init" \
        timeout "$(limit 150)" bash $KIT/train_single_node.sh --finetune > "$LOGS/convert_msa.log" 2>&1
    rc3=$?
    grep -E "iteration +[0-9]+/" "$LOGS/convert_dense.log" | cut -c1-200
    grep -E "loaded dense|saved the MSA" "$LOGS/convert.log"
    grep -E "loaded checkpoint|MSA attention mode|iteration +[0-9]+/" "$LOGS/convert_msa.log" | cut -c1-400
    d_first=$(loss 1 "$LOGS/convert_dense.log"); d_last=$(loss 4 "$LOGS/convert_dense.log"); m_first=$(loss 1 "$LOGS/convert_msa.log")
    echo "loss: dense iteration 1 $d_first, dense iteration 4 $d_last, MSA iteration 1 $m_first"
    near=$(python3 -c "a,b,c=map(float,'$d_first $d_last $m_first'.split()); print(int(abs(c-b) < abs(c-a)))" 2>/dev/null)
    if [ $rc1 = 0 ] && [ $rc2 = 0 ] && [ $rc3 = 0 ] && [ "$near" = 1 ]; then mark convert PASS
    else mark convert "FAIL(rc=$rc1/$rc2/$rc3)"; fi
fi

if [ -n "${TESTS_PID:-}" ]; then
    wait "$TESTS_PID"
    cat "$LOGS/tests_progress.log"
    if [ "$(cat "$RUN/tests.rc")" = 0 ]; then mark tests PASS; else mark tests "FAIL(rc=$(cat "$RUN/tests.rc"))"; fi
fi

# f. realistic recipe: 64 q heads / 4 KV heads / head dim 128 (hidden 8192), 64K tokens, CP=2
if has recipe && [ $(( BUDGET - $(elapsed) )) -lt "$RECIPE_S" ]; then
    mark recipe "SKIPPED(time: $(( BUDGET - $(elapsed) )) s left)"
elif has recipe; then
    SEQ=65536
    env TP=1 CP=2 SEQ_LEN=$SEQ NUM_LAYERS=2 HIDDEN=8192 FFN_HIDDEN=22016 HEADS=64 QUERY_GROUPS=4 \
        MICRO_BATCH=1 GLOBAL_BATCH=1 TRAIN_ITERS=4 MSA_WARMUP_STEPS=0 MSA_BLOCK_SIZE=128 \
        MSA_TOP_K=16 MSA_INDEX_HEAD_DIM=128 LOG_INTERVAL=1 EVAL_ITERS=1 SAVE_INTERVAL=1000 \
        CHECKPOINTS=0 OUT_DIR="$RUN/recipe" GPUS_PER_NODE=2 \
        timeout "$(limit 170)" bash $KIT/train_single_node.sh > "$LOGS/recipe.log" 2>&1
    rc=$?
    grep -E "turned off|iteration +[0-9]+/|peak GPU" "$LOGS/recipe.log" | cut -c1-300
    ms=$(grep -E "iteration +4/" "$LOGS/recipe.log" | sed -E 's/.*elapsed time per iteration \(ms\): ([0-9.]+).*/\1/')
    if [ $rc = 0 ] && [ -n "$ms" ]; then
        python3 -c "print(f'recipe: 64/4 heads x 128, {$SEQ} tokens, CP=2, 2 layers: {$SEQ / ($ms / 1000):.0f} tokens/s ({$ms:.0f} ms/iteration)')"
        mark recipe PASS
    else mark recipe "FAIL(rc=$rc)"; fi
fi

line="SUMMARY"
for s in tests data train resume convert recipe; do
    has $s && line="$line $s=${RESULT[$s]:-NOT_RUN}"
done
echo "$line total=$(elapsed)s" | tee "$LOGS/summary.txt"
cp "$LOGS/summary.txt" "$OUT/summary.txt"
tar czf "$OUT/megatron_lm_logs.tgz" -C "$LOGS" .
[[ "$line" != *FAIL* && "$line" != *NOT_RUN* ]]
