#!/usr/bin/env bash
# Does the KL-trained index find what matters? Train the same GPT on the retrieval task
# (examples/retrieval_task.py) four ways, same weights and data, and compare:
#   msa     MSA with the index trained by the KL loss
#   random  MSA with the index frozen at its random initialisation
#   local   own block only (top-k 1)
#   dense   dense attention every step
# One process trains the dense warm-up once and then each variant from its end (same weights,
# optimizer state and data), one after the other.
#
#   bash examples/run_retrieval.sh                        # 8K tokens, GPU 0
#   LEN=32768 STEPS=900 WARMUP=700 TOPK=16 bash examples/run_retrieval.sh --task-len 32768
#   RUNS=msa,dense DEVICE=cpu LEN=1024 BLOCK=32 bash examples/run_retrieval.sh --layers 2
#
# Environment: LEN (window tokens), STEPS, WARMUP (dense steps before the variants), TOPK,
# BLOCK, RUNS (comma-separated), DEVICE (cuda | cpu), OUT (default runs/retrieval_$LEN),
# PYTHON; PARALLEL (0 or 1; default 0): 1 trains the warm-up in a process of its own, which
# saves it (--save-warmup) and then trains the dense variant when RUNS names it (else it stops
# at the end of the warm-up: --warmup-until), and every other variant of RUNS starts from it as
# its own process, all at once (--load-warmup; set OMP_NUM_THREADS).
# WARMUP_DIR (PARALLEL: where the warm-up is saved; default $OUT/warmup, with PACK=1
# runs/retrieval_warmup_$LEN). Extra flags go to examples/pretrain_tiny.py (later flags win).
# Writes $OUT/variants/metrics.json and its log (PARALLEL: $OUT/<variant>/metrics.json and
# $OUT/<variant>.log; the warm-up's log is dense.log, or warmup.log when RUNS has no dense),
# then $OUT/retrieval.json, a table ($OUT/retrieval.md) and plots
# ($OUT/retrieval.png) from examples/retrieval_report.py.
#
# PACK=1 (for the device tool, which returns at most 8 files from its $OUT): at the end, every
# other file under $OUT (logs, <variant>/metrics.json, <variant>/pretrain_tiny.png) goes into
# one tarball $OUT/retrieval_logs.tgz (paths relative to $OUT) and is removed, leaving 4 files:
# retrieval.json, retrieval.md, retrieval.png and the tarball (unpacked into a directory, it is
# one that examples/retrieval_report.py reads); the warm-up is saved outside $OUT (WARMUP_DIR).
# Above 8 files under $OUT a warning on stderr (examples/out_files.sh, the rule's one place).
# E.g. PACK=1 PARALLEL=1 OUT=$OUT/text8k bash examples/run_retrieval.sh --task text
set -euo pipefail
cd "$(dirname "$0")/.."

LEN=${LEN:-8192}
STEPS=${STEPS:-1300}
WARMUP=${WARMUP:-1000}
TOPK=${TOPK:-8}
BLOCK=${BLOCK:-128}
RUNS=${RUNS:-msa,random,local,dense}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/retrieval_$LEN}
PYTHON=${PYTHON:-python3}
PACK=${PACK:-0}
case "$PACK" in 0|1) ;; *) echo "run_retrieval.sh: PACK=$PACK: use PACK=1 or PACK=0" >&2; exit 2 ;; esac
PARALLEL=${PARALLEL:-0}
case "$PARALLEL" in
    0|1) ;;
    *) echo "run_retrieval.sh: PARALLEL=$PARALLEL: use PARALLEL=1 or PARALLEL=0" >&2; exit 2 ;;
esac
if [ "$PACK" = 1 ]; then WARMUP_DIR=${WARMUP_DIR:-runs/retrieval_warmup_$LEN}; fi
WARMUP_DIR=${WARMUP_DIR:-$OUT/warmup}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck source=out_files.sh
source examples/out_files.sh   # msa_out_files, msa_warn_out_files: the device tool's 8 files
# shellcheck source=check_settings.sh
source examples/check_settings.sh  # msa_check_settings: pretrain_tiny.py --check-only

# Held-out exact match every 100 steps is the retrieval task's (pretrain_tiny refuses the
# retrieval-only flags with --task text, which this script also serves).
case " $* " in *" --task text "*|*" --task=text "*) EVAL=() ;; *) EVAL=(--eval-interval 100) ;; esac
COMMON=(--task retrieval --device "$DEVICE" --seq-len "$LEN" --steps "$STEPS"
        --warmup-steps "$WARMUP" --top-k "$TOPK" --block-size "$BLOCK" --layers 4 --hidden 256 --ffn-hidden 704
        --heads 4 --query-groups 2 --index-head-dim 64 --lr 2e-3 --lr-warmup 50
        --log-interval 50 ${EVAL[@]+"${EVAL[@]}"} --eval-windows 2)
# PARALLEL=1: the warm-up's process (the dense variant's when RUNS names it: same --steps, so
# the same learning-rate schedule; else one that stops at the end of the warm-up).
case ",$RUNS," in
    *,dense,*) FIRST=dense; UNTIL=() ;;
    *) FIRST=warmup; UNTIL=(--warmup-until "$WARMUP") ;;
esac
FIRST_FLAGS=("${COMMON[@]}" --runs dense ${UNTIL[@]+"${UNTIL[@]}"} --save-warmup "$WARMUP_DIR"
             --out-dir "$OUT/$FIRST")
# The settings (these variables and the flags) are checked once, before OUT is touched: a
# refused run leaves an earlier run's results in OUT as they were (exit 2, pretrain_tiny.py's
# message). PARALLEL=1 also checks the warm-up's process (the others load a warm-up not saved
# yet).
msa_check_settings "$PYTHON" "${COMMON[@]}" --runs "$RUNS" --out-dir "$OUT/variants" "$@" \
    || exit 2
if [ "$PARALLEL" = 1 ]; then msa_check_settings "$PYTHON" "${FIRST_FLAGS[@]}" "$@" || exit 2; fi

mkdir -p "$OUT"
# The report reads every $OUT/*/metrics.json: drop those of an earlier run into the same OUT, so
# that a variant not run (or failed) this time cannot show its old numbers.
rm -f "$OUT"/*/metrics.json "$OUT"/retrieval.json "$OUT"/retrieval.md "$OUT"/retrieval.png \
    "$OUT"/retrieval_logs.tgz
status=0
if [ "$PARALLEL" = 1 ]; then
    # The warm-up's process ($FIRST, see FIRST_FLAGS) trains the warm-up and saves it; once
    # saved, every other variant starts from it as its own process, side by side. The report
    # reads $OUT/<variant>/metrics.json.
    port=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
    MASTER_PORT=$port "$PYTHON" examples/pretrain_tiny.py "${FIRST_FLAGS[@]}" "$@" \
        >"$OUT/$FIRST.log" 2>&1 &
    first=$!
    saved() { grep -q "saved the warm-up" "$OUT/$FIRST.log" 2>/dev/null; }
    until saved; do  # (saved once more after the exit: the warm-up-only process ends at once)
        if ! kill -0 "$first" 2>/dev/null && ! saved; then
            wait "$first" || true; echo "warm-up failed: $OUT/$FIRST.log" >&2; exit 1
        fi
        sleep 5
    done
    pids=("$first")
    for run in ${RUNS//,/ }; do
        [ "$run" = dense ] && continue
        port=$((port + 1))
        MASTER_PORT=$port "$PYTHON" examples/pretrain_tiny.py "${COMMON[@]}" --runs "$run" \
            --load-warmup "$WARMUP_DIR" --out-dir "$OUT/$run" "$@" \
            >"$OUT/$run.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    for run in ${RUNS//,/ }; do grep -v -i warn "$OUT/$run.log" | tail -3; done
else
    MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))} "$PYTHON" examples/pretrain_tiny.py \
        "${COMMON[@]}" --runs "$RUNS" --out-dir "$OUT/variants" "$@" \
        >"$OUT/variants.log" 2>&1 || status=$?
    grep -v -i warn "$OUT/variants.log" | tail -12
fi
"$PYTHON" examples/retrieval_report.py "$OUT" || status=1
if [ "$PACK" = 1 ]; then
    # everything but the report's three files into one tarball; then only those four remain
    packed=$(cd "$OUT" && find . -type f ! -path ./retrieval.json ! -path ./retrieval.md \
             ! -path ./retrieval.png ! -path ./retrieval_logs.tgz | sort)
    if [ -n "$packed" ]; then
        (cd "$OUT" && printf '%s\n' "$packed" | tar czf retrieval_logs.tgz -T -) || exit 1
        (cd "$OUT" && printf '%s\n' "$packed" | while IFS= read -r f; do rm -f "$f"; done)
        find "$OUT" -mindepth 1 -type d -empty -delete
    fi
    echo "PACK=1: $OUT holds $(msa_out_files "$OUT") files ($(cd "$OUT" && ls | tr '\n' ' '))"
    msa_warn_out_files run_retrieval.sh "$OUT"
fi
exit $status
