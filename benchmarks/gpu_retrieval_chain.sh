#!/usr/bin/env bash
# Issue 19 on 1 or 2 H200s, recipe v4 (examples/README.md "Making dense attention learn the
# task": recipe v3 with a 9000-step warm-up and 6 held-out windows): a dense warm-up chained
# over device calls, then the comparison msa / random / local / dense from its end. Successor
# of gpu_retrieval_fused.sh (commit fbf44b4).
#
#   PHASE=warmup    one link of the warm-up on GPU 0: continue the carried (or kept) warm-up,
#                   train WARMUP_S seconds, save it; it comes back as $OUT/$NAME.tgz.part-NN
#                   (pieces of 15 MiB: the device tool returns files of at most 16 MiB), their
#                   checksum $OUT/$NAME.tgz.sha256 and the warm-up's log $OUT/${NAME}_warmup.log.
#                   A complete warm-up is not trained further (it says so; run PHASE=variants).
#                   A warm-up saved (or kept on a still-warm machine) with other settings than
#                   this call's is refused up front, before any training (exit 2; the message
#                   names the settings that differ and the fix: rm -rf runs/$NAME runs/carry, or
#                   the settings it was saved with): pretrain_tiny.py --check-only with the
#                   flags of the link or of the variants.
#                   With a second GPU and B_FLAGS set, lane B trains the same recipe with
#                   B_FLAGS added (later flags win) from scratch for the same time, to compare
#                   recipes; its state is not kept, its log comes back ($OUT/${NAME}_b.log).
#   PHASE=variants  finish the warm-up if it is not done (at most FINISH_S seconds), then train
#                   msa / random / local / dense from it, spread over the visible GPUs (lane i
#                   on GPU i mod count, LANE_S seconds each at most), then
#                   examples/retrieval_report.py. Returns $OUT/retrieval_$NAME.json, .md and
#                   $OUT/retrieval_${NAME}_logs.tgz: the plot (retrieval.png), the warm-up's
#                   and every lane's log (*.log) and metrics (<run>/metrics.json), relative to
#                   runs/$NAME (unpacked into a directory, it is one that retrieval_report.py
#                   reads; python examples/retrieval_report.py --from-json
#                   retrieval_$NAME.json redraws the table and the plot from the JSON alone).
#
# Files returned: the device tool returns at most 8 files from $OUT (16 MiB each, 64 MiB in
# all: a warm-up of 4 pieces at most). PHASE=warmup returns the pieces (3 for the 38 MiB 32K
# warm-up), their checksum and the warm-up's log (and lane B's): 7 at most. PHASE=variants
# returns the JSON, the .md, the tarball and (KEEP_WARMUP=1) the pieces and their checksum: 8
# at most (7 for a 3-piece warm-up); should the pieces leave no room, the .md goes into the
# tarball. At the end the script counts the files under $OUT and warns on stderr above 8
# (examples/out_files.sh, shared with examples/run_retrieval.sh PACK=1).
#
# Carrying the warm-up into the next call: replace runs/carry/ of the repository by the
# returned pieces and their checksum (rm -rf runs/carry; mkdir -p runs/carry;
# cp <files_at>/$NAME.tgz.* runs/carry/) and pass carry=[".whl", "runs/carry"]. The pieces are
# checked against $NAME.tgz.sha256 and unpacked on the device (pieces of two calls mixed are
# refused), then removed there (runs/carry/$NAME.tgz.*, runs/carry_init/$INIT.tgz.*): a later
# call on the still-warm machine does not unpack them again over a newer warm-up. A warm-up
# left on a still-warm machine is used when nothing was carried. Every link and the variants
# must use the same settings (LEN_TASK, WARMUP, STEPS, the recipe): a warm-up saved with others
# is refused up front (exit 2, see PHASE=warmup). PHASE=variants also returns the finished
# warm-up's pieces (KEEP_WARMUP=0: not), so that it can seed a longer run.
#
# Length extension (examples/README.md "Length extension"): INIT=<name of another warm-up,
# e.g. r8192> starts this warm-up from that one's weights (pretrain_tiny --init-weights; fresh
# optimizer, schedule and data). Its returned pieces go to runs/carry_init/ (cp
# <files_at>/r8192.tgz.* runs/carry_init/) and are carried on the FIRST link only
# (carry=[".whl", "runs/carry_init"]: two warm-ups exceed the 64 MiB a call carries); later
# links and the variants keep INIT set and carry runs/carry as usual (the saved warm-up records
# its source, which need not be present any more; INIT is not checked against a warm-up that is
# already complete). 32K from the 8K warm-up, one H200, one call (~400 s; 2026-12-01): the
# dense warm-up of 1500 steps took 199 s, the four lanes of 600 sparse steps side by side
# ~190 s. runs/carry_init holds the 8K warm-up's pieces; the rm -rf first drops what a
# still-warm machine kept of an earlier call (a warm-up saved with other settings is refused):
#   run(kind="nvidia-h200", carry=[".whl", "runs/carry_init"], command="rm -rf runs/r32768 runs/carry; export LEN_TASK=32768 WINDOW=32768 TOPK=16 WARMUP=1500 STEPS=2100 INIT=r8192; PHASE=warmup bash benchmarks/gpu_retrieval_chain.sh; rm -rf runs/carry_init; PHASE=variants FINISH_S=60 LANE_S=310 bash benchmarks/gpu_retrieval_chain.sh")
# Held out (192 questions), dense / MSA trained / MSA random / own block: exact match 0.969 /
# 0.922 / 0.229 / 0.151, recall 0.847 / 0.805 / 0.534 / 0.397, best recall 0.854 / 0.815 /
# 0.735 / 0.397. Top-k 32 from the same warm-up (its pieces in runs/carry, 246 s, 2026-12-01 s10):
#   run(kind="nvidia-h200", carry=[".whl", "runs/carry"], command="rm -rf runs/r32768 runs/carry_init; export LEN_TASK=32768 WINDOW=32768 TOPK=32 WARMUP=1500 STEPS=2100 INIT=r8192; PHASE=variants FINISH_S=60 LANE_S=310 KEEP_WARMUP=0 bash benchmarks/gpu_retrieval_chain.sh")
# exact match 0.969 / 0.927 / 0.255 / 0.151, recall 0.893 / 0.874 / 0.651 / 0.397, best recall
# 0.901 / 0.884 / 0.849 / 0.397.
#
# Environment: MASTER_PORT (29651: the warm-up link's rendezvous port; lane B +100, the
# variant lanes +10 to +13; set another for two calls on one host), LEN_TASK (8192), WINDOW
# (16384 tokens per step), WARMUP (dense steps, 9000; >= 1),
# STEPS (WARMUP + 400), TOPK (8), LR (3e-3), KEYS (32), VALUES (8), GATE (1.0: the longest
# training length doubles whenever the mean training answer loss over 50 steps is below it),
# EXTRA (more flags for every lane; later flags win), TAG (names a second warm-up of the same
# length), INIT (none), KEEP_WARMUP (1), WARMUP_S (470), FINISH_S (300), LANE_S (240). At
# ~0.08 s per step (held-out evaluations included) the 9000 warm-up steps take two calls: the
# first link reached step 5777 in its 470 s (2026-12-01), the second call's FINISH_S=300
# finished the other 3223, and the four lanes of 400 steps fit in LANE_S=240 side by side on one H200 (413 s for that call).
# If the first link's log shows fewer than ~5500 steps (slower steps), run PHASE=warmup once
# more before PHASE=variants; if the warm-up is still not done, PHASE=variants returns it
# (exit 1) for one more call.
#
# Exit status: 0 when the phase did its work; 2 for a saved warm-up of other settings (either
# phase, before any training), for an unknown PHASE, a number that is not a whole one,
# WARMUP=0, STEPS <= WARMUP and a recipe (or, PHASE=warmup, lane B's recipe with B_FLAGS)
# that pretrain_tiny.py --check-only refuses (its message; all before anything starts); PHASE=warmup: the link's own when it failed (2:
# settings refused, 124: stopped by its timeout, its steps not saved); PHASE=variants: 1 when
# the warm-up is not finished (its pieces come back for another link) or a lane failed; 1 for
# carried pieces that do not unpack.
#
# Device tool, one GPU (the run of benchmarks/results/retrieval/gpu_2026-12-01_s8/):
#   run(kind="nvidia-h200", carry=[".whl"], command="PHASE=warmup bash benchmarks/gpu_retrieval_chain.sh")
#   (here: rm -rf runs/carry && mkdir -p runs/carry && cp <files_at>/r8192.tgz.* runs/carry/)
#   run(kind="nvidia-h200", carry=[".whl", "runs/carry"], command="PHASE=variants bash benchmarks/gpu_retrieval_chain.sh")
# Two GPUs: the same with kind="nvidia-h200-x2"; the first call may add B_FLAGS='--value-vocab 32'
# (lane B on GPU 1), and the variants then run two lanes per GPU.
set -u
PHASE=${PHASE:-warmup}
case "$PHASE" in warmup|variants) ;;
    *) echo "gpu_retrieval_chain.sh: PHASE=$PHASE: use PHASE=warmup or PHASE=variants" >&2
       exit 2 ;;
esac
for var in LEN_TASK WINDOW WARMUP STEPS TOPK WARMUP_S FINISH_S LANE_S MASTER_PORT; do
    case "${!var:-1}" in
        ''|*[!0-9]*) echo "gpu_retrieval_chain.sh: $var=${!var} must be a whole number" >&2
                     exit 2 ;;
    esac
done
if [ "$((10#${WARMUP:-1}))" -eq 0 ]; then  # else "complete" at step 0, and no warm-up to pack
    echo "gpu_retrieval_chain.sh: WARMUP=$WARMUP: the variants start from the end of a dense" \
         "warm-up of at least 1 step: give WARMUP >= 1 (9000 at 8K; 1500 at 32K from INIT)" >&2
    exit 2
fi
if [ -n "${STEPS:-}" ] && [ "$((10#$STEPS))" -le "$((10#${WARMUP:-9000}))" ]; then
    echo "gpu_retrieval_chain.sh: STEPS=$STEPS must exceed WARMUP=${WARMUP:-9000}: the variants" \
         "train steps WARMUP+1 .. STEPS (default STEPS = WARMUP + 400)" >&2
    exit 2
fi
. benchmarks/gpu_env.sh
. examples/out_files.sh  # msa_out_files, msa_warn_out_files: the device tool's 8 files
. examples/check_settings.sh  # msa_check_settings: pretrain_tiny.py --check-only
LEN_TASK=${LEN_TASK:-8192}; WINDOW=${WINDOW:-16384}; WARMUP=${WARMUP:-9000}
STEPS=${STEPS:-$((WARMUP + 400))}; TOPK=${TOPK:-8}; WARMUP_S=${WARMUP_S:-470}
FINISH_S=${FINISH_S:-300}; LANE_S=${LANE_S:-240}; PORT_BASE=$((10#${MASTER_PORT:-29651}))
NAME=r$LEN_TASK${TAG:-}; R=runs/$NAME
if [ -n "${INIT:-}" ] && [ "$INIT" = "$NAME" ]; then
    echo "gpu_retrieval_chain.sh: INIT=$INIT is this run's own warm-up: name another" >&2
    exit 2
fi
RECIPE="--task retrieval --record-format fused --seq-len $WINDOW --task-len $LEN_TASK
 --task-len-min 64 --task-curriculum-gate ${GATE:-1.0} --task-question-every 8 --pairs 32
 --queries 32 --key-vocab ${KEYS:-32} --value-vocab ${VALUES:-8} --min-distance $((LEN_TASK / 4))
 --answer-weight 64 --layers 4 --hidden 256 --ffn-hidden 704 --heads 4 --query-groups 2
 --index-head-dim 64 --block-size 128 --top-k $TOPK --rotary-base 1000000 --lr ${LR:-3e-3}
 --lr-warmup 50 --warmup-steps $WARMUP --steps $STEPS --log-interval 100 --eval-interval 500
 --probe-interval 500 --eval-windows 6 ${EXTRA:-}"
# The recipe as pretrain_tiny.py checks it (every lane's variant), before anything starts: the
# shell checks above stay, as pretrain_tiny accepts a WARMUP and STEPS that the chain cannot use.
if ! msa_check_settings python3 $RECIPE; then
    echo "gpu_retrieval_chain.sh: pretrain_tiny.py refuses the recipe (LEN_TASK, WINDOW, WARMUP," \
         "STEPS, TOPK, LR, KEYS, VALUES, GATE, EXTRA): nothing was started" >&2
    exit 2
fi
# Lane B's recipe too (PHASE=warmup reads B_FLAGS), whatever the GPU count.
if [ "$PHASE" = warmup ] && [ -n "${B_FLAGS:-}" ] && ! msa_check_settings python3 $RECIPE $B_FLAGS
then
    echo "gpu_retrieval_chain.sh: pretrain_tiny.py refuses lane B's recipe (B_FLAGS=$B_FLAGS):" \
         "nothing was started" >&2
    exit 2
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SAVED="$R/warmup/warmup_rank000_of001.pt"
gpus=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
mkdir -p "$R"

unpack() {  # unpack() DIR NAME: the pieces DIR/NAME.tgz.part-* into runs/NAME/warmup
    local sum=$1/$2.tgz.sha256
    if [ -f "$sum" ] && [ "$(cat "$1/$2".tgz.part-* | sha256sum | cut -d' ' -f1)" \
            != "$(cut -d' ' -f1 "$sum")" ]; then
        echo "$1/$2.tgz.part-* do not match $sum (pieces missing, or from two" \
             "calls mixed): carry exactly the files of one call" >&2
        exit 1
    fi
    mkdir -p "runs/$2" && rm -rf "runs/$2/warmup"
    if ! cat "$1/$2".tgz.part-* | tar xzf - -C "runs/$2"; then
        echo "$1/$2.tgz.part-* do not unpack (cut, or from two calls mixed):" \
             "carry exactly the files of one call" >&2
        exit 1
    fi
    echo "warm-up unpacked from $1 ($(ls "$1/$2".tgz.part-* | wc -l) pieces)"
    # used once: a later call on this still-warm machine must not unpack them again over a
    # newer warm-up (the device keeps ignored paths that a call does not carry)
    rm -f "$1/$2".tgz.part-* "$1/$2.tgz.sha256"
}
restore() {  # the carried pieces win; else a warm-up kept on this machine from the last call
    if ls runs/carry/"$NAME".tgz.part-* >/dev/null 2>&1; then unpack runs/carry "$NAME"
    elif [ -f "$SAVED" ]; then echo "warm-up kept on this machine"
    else echo "no warm-up yet: starting one"; fi
    [ -n "${INIT:-}" ] || return 0
    if ls runs/carry_init/"$INIT".tgz.part-* >/dev/null 2>&1; then
        unpack runs/carry_init "$INIT"
    elif [ ! -f "$SAVED" ] && [ ! -d "runs/$INIT/warmup" ]; then
        echo "INIT=$INIT: no runs/$INIT/warmup to start from: carry its pieces in" \
             "runs/carry_init/ (carry=[\".whl\", \"runs/carry_init\"])" >&2
        exit 1
    fi
}
saved_step() {  # warm-up steps held by the saved warm-up (0: none); exits when unreadable
    [ -f "$SAVED" ] || { echo 0; return; }
    local step
    step=$(python3 -c "import torch; s = torch.load('$SAVED', weights_only=True, mmap=True, map_location='cpu')
print(s.get('step', $WARMUP))" 2>/dev/null | tail -n 1)
    case "$step" in
        ''|*[!0-9]*) echo "$SAVED cannot be read: carry the pieces of one call again" >&2
                     exit 1 ;;
    esac
    echo "$step"
}
pack() {  # the warm-up into $OUT as pieces of 15 MiB and their checksum
    rm -f "$OUT/$NAME".tgz.part-* "$OUT/$NAME.tgz.sha256"
    tar czf "$R/warmup.tgz" -C "$R" warmup || exit 1
    (cd "$R" && sha256sum warmup.tgz) > "$OUT/$NAME.tgz.sha256"
    split -b 15m -d "$R/warmup.tgz" "$OUT/$NAME.tgz.part-" && rm -f "$R/warmup.tgz"
}
finish() {  # finish STATUS: list $OUT, warn when the device tool would drop files, exit STATUS
    ls -la "$OUT"
    msa_warn_out_files gpu_retrieval_chain.sh "$OUT"
    exit "$1"
}
finish_link() {  # finish_link STATUS: the warm-up's log into $OUT beside its pieces, then
    # finish STATUS (the warm-up phase, and a variants call whose warm-up is not done)
    cp "$R/warmup.log" "$OUT/${NAME}_warmup.log" 2>/dev/null
    finish "$1"
}
check_saved() {  # check_saved FLAGS...: pretrain_tiny's check of the saved warm-up against
    # this call's settings (--check-only: nothing trains); exits 2, naming the fix, if refused
    [ -f "$SAVED" ] || return 0
    if ! msa_check_settings python3 $RECIPE "$@"; then
        echo "gpu_retrieval_chain.sh: the warm-up in $R (carried, or kept on this machine from" \
             "an earlier call) does not fit this call's settings: remove it (rm -rf $R" \
             "runs/carry) to start anew, or run with the settings it was saved with" >&2
        exit 2
    fi
}
link() {  # train the warm-up for $1 seconds (continuing a saved one), save it; its exit status
    local resume=() status from
    [ -f "$SAVED" ] && resume=(--resume-warmup "$R/warmup")
    [ -n "${INIT:-}" ] && resume+=(--init-weights "runs/$INIT/warmup")  # every link: same flags
    from=$(($(cat "$R/warmup.log" 2>/dev/null | wc -l) + 1))  # this link's lines start there
    CUDA_VISIBLE_DEVICES=0 MASTER_PORT=$PORT_BASE timeout $(($1 + 240)) python3 \
        examples/pretrain_tiny.py $RECIPE --runs dense "${resume[@]}" --save-warmup "$R/warmup" \
        --warmup-seconds "$1" --out-dir "$R/dense" >> "$R/warmup.log" 2>&1
    status=$?
    echo "warm-up link exit $status"
    tail -n +"$from" "$R/warmup.log" | grep -v -i warn \
        | grep "exact match\|saved\|loaded\|curriculum:\|step .*00/" | tail -n 40
    if [ "$status" != 0 ]; then
        [ "$status" = 124 ] && echo "the link ran past $(($1 + 240)) s and was stopped: its" \
            "steps were not saved (the warm-up is as it was before this link)"
        echo "--- end of $R/warmup.log:"
        tail -n +"$from" "$R/warmup.log" | grep -v -i warn | tail -n 15
    fi
    return "$status"
}

restore
done_steps=$(saved_step) || exit 1
if [ "$done_steps" -ge "$WARMUP" ]; then  # the flags of the variants' lanes
    check_saved --runs msa --load-warmup "$R/warmup" --out-dir "$R/msa"
else  # those of the next link
    check_saved --runs dense --resume-warmup "$R/warmup" \
        ${INIT:+--init-weights "runs/$INIT/warmup"} --save-warmup "$R/warmup" \
        --warmup-seconds "$WARMUP_S" --out-dir "$R/dense"
fi
if [ "$PHASE" = warmup ]; then
    if [ "$done_steps" -ge "$WARMUP" ]; then
        echo "the warm-up is complete (step $done_steps of $WARMUP): run PHASE=variants"
        pack; finish_link 0
    fi
    if [ -n "${B_FLAGS:-}" ] && [ "$gpus" -lt 2 ]; then
        echo "B_FLAGS set but only $gpus GPU: lane B does not run"
    elif [ -n "${B_FLAGS:-}" ]; then
        rm -rf "$R/b_warmup"  # lane B starts from scratch every call
        CUDA_VISIBLE_DEVICES=1 MASTER_PORT=$((PORT_BASE + 100)) timeout $((WARMUP_S + 240)) python3 \
            examples/pretrain_tiny.py $RECIPE $B_FLAGS --runs dense --save-warmup "$R/b_warmup" \
            --warmup-seconds "$WARMUP_S" --out-dir "$R/b" > "$R/b.log" 2>&1 &
    fi
    link "$WARMUP_S"; status=$?
    wait
    if [ -f "$R/b.log" ]; then
        echo "=== lane B (${B_FLAGS:-})"
        grep -v -i warn "$R/b.log" | grep "exact match\|saved\|curriculum:\|step .*00/\|error\|invalid\|  - " \
            | tail -n 30
        cp "$R/b.log" "$OUT/${NAME}_b.log"
    fi
    [ -f "$SAVED" ] && pack
    finish_link "$status"
fi

if [ "$done_steps" -lt "$WARMUP" ]; then
    echo "warm-up at step $done_steps of $WARMUP: finishing it (at most $FINISH_S s)"
    link "$FINISH_S"
    done_steps=$(saved_step) || exit 1
fi
if [ "$done_steps" -lt "$WARMUP" ]; then
    echo "warm-up still at step $done_steps of $WARMUP: returned for another link"
    [ -f "$SAVED" ] && pack
    finish_link 1
fi
port=$((PORT_BASE + 9)); i=0; pids=()
rm -f "$R"/{msa,random,local,dense}/metrics.json  # the report must not show an earlier call's
visible=(${CUDA_VISIBLE_DEVICES:+${CUDA_VISIBLE_DEVICES//,/ }})
for run in msa random local dense; do
    port=$((port + 1)); gpu=$((i % gpus)); i=$((i + 1))
    [ ${#visible[@]} -gt 0 ] && gpu=${visible[$gpu]}
    CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$port timeout "$LANE_S" python3 \
        examples/pretrain_tiny.py $RECIPE --runs "$run" --load-warmup "$R/warmup" \
        --out-dir "$R/$run" > "$R/$run.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for run in msa random local dense; do
    echo "=== $run"
    grep -v -i warn "$R/$run.log" | grep "exact match\|held-out\|Error\|error:\|invalid\|  - " \
        | tail -n 4
done
python3 examples/retrieval_report.py "$R" || status=1
# At most 8 files come back: the JSON and the .md beside the tarball of the plot, logs and
# metrics (paths relative to $R) and the warm-up's pieces; the .md joins the tarball when the
# pieces leave no room for it.
rm -f "$OUT"/retrieval_"$NAME".* "$OUT/retrieval_${NAME}_logs.tgz" "$OUT/${NAME}_warmup.log"
[ "${KEEP_WARMUP:-1}" = 1 ] && pack  # the finished warm-up comes back: it can seed a longer run
cp "$R/retrieval.json" "$OUT/retrieval_$NAME.json" 2>/dev/null
packed=(retrieval.png)
if [ "$(msa_out_files "$OUT")" -le $((MSA_OUT_MAX_FILES - 2)) ]; then
    cp "$R/retrieval.md" "$OUT/retrieval_$NAME.md" 2>/dev/null
else
    packed+=(retrieval.md)
fi
(cd "$R" && tar czf - $(ls -d "${packed[@]}" *.log */metrics.json 2>/dev/null)) \
    > "$OUT/retrieval_${NAME}_logs.tgz"
finish "$status"
