#!/usr/bin/env bash
# Issue 19 on 1 or 2 H200s, recipe v3 (examples/README.md "Making dense attention learn the
# task"): a dense warm-up chained over device calls, then the comparison msa / random / local /
# dense from its end. Successor of gpu_retrieval_fused.sh.
#
#   PHASE=warmup    one link of the warm-up on GPU 0: continue the carried (or kept) warm-up,
#                   train WARMUP_S seconds, save it; it comes back as $OUT/$NAME.tgz.part-NN
#                   (pieces of 15 MiB: the device tool returns files of at most 16 MiB).
#                   With a second GPU and B_FLAGS set, lane B trains the same recipe with
#                   B_FLAGS added (later flags win) from scratch for the same time, to compare
#                   recipes; its state is not kept, its log comes back ($OUT/${NAME}_b.log).
#   PHASE=variants  finish the warm-up if it is not done (at most FINISH_S seconds), then train
#                   msa / random / local / dense from it, spread over the visible GPUs (lane i
#                   on GPU i mod count, LANE_S seconds each at most), then
#                   examples/retrieval_report.py ($OUT/retrieval_$NAME.md, .json, .png and a
#                   tarball of logs and metrics).
#
# Carrying the warm-up into the next call: copy the returned pieces into runs/carry/ of the
# repository (mkdir -p runs/carry; cp <files_at>/$NAME.tgz.part-* runs/carry/) and pass
# carry=[".whl", "runs/carry"]. The pieces are unpacked on the device; a warm-up left on a
# still-warm machine is used when nothing was carried. Every link and the variants must use the
# same settings (LEN_TASK, WARMUP, STEPS, the recipe): the run refuses a warm-up saved with
# others.
#
# Environment: LEN_TASK (8192), WINDOW (16384 tokens per step), WARMUP (dense steps, 5000),
# STEPS (WARMUP + 400), TOPK (8), LR (3e-3), KEYS (32), VALUES (8), GATE (1.0: the longest
# training length doubles whenever the mean training answer loss over 50 steps is below it),
# EXTRA (more flags for every lane), TAG (names a second warm-up of the same length),
# WARMUP_S (470), FINISH_S (200), LANE_S (270). At ~0.12 s per step, 5000 warm-up steps take
# ~600 s: one full link and the second call's FINISH_S. If the first link's log shows fewer
# than ~3500 steps (slower steps), run PHASE=warmup once more before PHASE=variants; if the
# warm-up is still not done, PHASE=variants returns it (exit 1) for one more call.
#
# Device tool, 2 GPUs (on one GPU the same commands, without lane B):
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="PHASE=warmup B_FLAGS='--value-vocab 32' bash benchmarks/gpu_retrieval_chain.sh")
#   (here: mkdir -p runs/carry && cp <files_at>/r8192.tgz.part-* runs/carry/)
#   run(kind="nvidia-h200-x2", carry=[".whl", "runs/carry"], command="PHASE=variants bash benchmarks/gpu_retrieval_chain.sh")
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
LEN_TASK=${LEN_TASK:-8192}; WINDOW=${WINDOW:-16384}; WARMUP=${WARMUP:-5000}
STEPS=${STEPS:-$((WARMUP + 400))}; TOPK=${TOPK:-8}
NAME=r$LEN_TASK${TAG:-}; R=runs/$NAME
RECIPE="--task retrieval --record-format fused --seq-len $WINDOW --task-len $LEN_TASK
 --task-len-min 64 --task-curriculum-gate ${GATE:-1.0} --task-question-every 8 --pairs 32
 --queries 32 --key-vocab ${KEYS:-32} --value-vocab ${VALUES:-8} --min-distance $((LEN_TASK / 4))
 --answer-weight 64 --layers 4 --hidden 256 --ffn-hidden 704 --heads 4 --query-groups 2
 --index-head-dim 64 --block-size 128 --top-k $TOPK --rotary-base 1000000 --lr ${LR:-3e-3}
 --lr-warmup 50 --warmup-steps $WARMUP --steps $STEPS --log-interval 100 --eval-interval 500
 --probe-interval 500 --eval-windows 2 ${EXTRA:-}"
SAVED="$R/warmup/warmup_rank000_of001.pt"
gpus=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
mkdir -p "$R"

restore() {  # the carried pieces win; else a warm-up kept on this machine from the last call
    if ls runs/carry/"$NAME".tgz.part-* >/dev/null 2>&1; then
        rm -rf "$R/warmup"; cat runs/carry/"$NAME".tgz.part-* | tar xzf - -C "$R" || exit 1
        echo "warm-up unpacked from runs/carry"
    elif [ -f "$SAVED" ]; then echo "warm-up kept on this machine"
    else echo "no warm-up yet: starting one"; fi
}
saved_step() {  # warm-up steps held by the saved warm-up (0: none)
    [ -f "$SAVED" ] || { echo 0; return; }
    python3 -c "import torch; print(torch.load('$SAVED', weights_only=True).get('step', $WARMUP))"
}
link() {  # train the warm-up for $1 seconds (continuing a saved one), save it
    local resume=(); [ -f "$SAVED" ] && resume=(--resume-warmup "$R/warmup")
    CUDA_VISIBLE_DEVICES=0 MASTER_PORT=29651 timeout $(($1 + 240)) python3 \
        examples/pretrain_tiny.py $RECIPE --runs dense "${resume[@]}" --save-warmup "$R/warmup" \
        --warmup-seconds "$1" --out-dir "$R/dense" >> "$R/warmup.log" 2>&1
    echo "warm-up link exit $?"
    grep -v -i warn "$R/warmup.log" | grep "exact match\|saved\|loaded\|curriculum:\|step .*00/" \
        | tail -n 40
}

restore
if [ "${PHASE:-warmup}" = warmup ]; then
    if [ -n "${B_FLAGS:-}" ] && [ "$gpus" -ge 2 ]; then
        CUDA_VISIBLE_DEVICES=1 MASTER_PORT=29751 timeout $((${WARMUP_S:-470} + 240)) python3 \
            examples/pretrain_tiny.py $RECIPE $B_FLAGS --runs dense --save-warmup "$R/b_warmup" \
            --warmup-seconds "${WARMUP_S:-470}" --out-dir "$R/b" > "$R/b.log" 2>&1 &
    fi
    link "${WARMUP_S:-470}"
    wait
    if [ -f "$R/b.log" ]; then
        echo "=== lane B (${B_FLAGS:-})"
        grep -v -i warn "$R/b.log" | grep "exact match\|saved\|curriculum:\|step .*00/" | tail -n 30
        cp "$R/b.log" "$OUT/${NAME}_b.log"
    fi
    rm -f "$OUT/$NAME".tgz.part-*
    tar czf - -C "$R" warmup | split -b 15m -d - "$OUT/$NAME.tgz.part-"
    cp "$R/warmup.log" "$OUT/${NAME}_warmup.log"; ls -la "$OUT"
    exit 0
fi

done_steps=$(saved_step)
if [ "$done_steps" -lt "$WARMUP" ]; then
    echo "warm-up at step $done_steps of $WARMUP: finishing it (at most ${FINISH_S:-200} s)"
    link "${FINISH_S:-200}"
    done_steps=$(saved_step)
fi
if [ "$done_steps" -lt "$WARMUP" ]; then
    echo "warm-up still at step $done_steps of $WARMUP: returned for another link"
    rm -f "$OUT/$NAME".tgz.part-*
    tar czf - -C "$R" warmup | split -b 15m -d - "$OUT/$NAME.tgz.part-"
    cp "$R/warmup.log" "$OUT/${NAME}_warmup.log"
    exit 1
fi
port=29660; i=0
visible=(${CUDA_VISIBLE_DEVICES:+${CUDA_VISIBLE_DEVICES//,/ }})
for run in msa random local dense; do
    port=$((port + 1)); gpu=$((i % gpus)); i=$((i + 1))
    [ ${#visible[@]} -gt 0 ] && gpu=${visible[$gpu]}
    CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$port timeout "${LANE_S:-270}" python3 \
        examples/pretrain_tiny.py $RECIPE --runs "$run" --load-warmup "$R/warmup" \
        --out-dir "$R/$run" > "$R/$run.log" 2>&1 &
done
wait
for run in msa random local dense; do
    echo "=== $run"; grep -v -i warn "$R/$run.log" | grep "exact match\|held-out\|Error" | tail -n 4
done
python3 examples/retrieval_report.py "$R"
for f in json md png; do cp "$R/retrieval.$f" "$OUT/retrieval_$NAME.$f" 2>/dev/null; done
tar czf "$OUT/retrieval_${NAME}_logs.tgz" "$R"/*.log "$R"/*/metrics.json 2>/dev/null
ls -la "$OUT"
