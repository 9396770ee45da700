#!/usr/bin/env bash
# Pass-A kernel variants of the Gluon dense KL on the GPU, each checked and timed in its own
# processes (benchmarks/gluon_probe.py kl), writing $OUT/kl_<variant>.json:
#   OUT=... VARIANTS="split:4:1 split:4:2:p fused" LSE_Z=finite TOKENS="32768" \
#       CHILDREN="check time_gluon" bash benchmarks/gpu_dense_kl_variants.sh
# VARIANTS: KL_PASS_A values (kernel[:Q stages:K stages[:p]]); LSE_Z: KL_LSE_Z (finite /
# general); CHILDREN: gluon_probe kl --children.
set -u
. benchmarks/gpu_env.sh
: "${OUT:?set OUT}"
for v in ${VARIANTS:-split:4:1}; do
    name=${v//:/_}
    KL_PASS_A=$v KL_LSE_Z=${LSE_Z:-general} timeout "${VARIANT_LIMIT:-240}" \
        python benchmarks/gluon_probe.py kl "$OUT/kl_$name.json" --tokens ${TOKENS:-32768} \
        --timeout "${CHILD_LIMIT:-100}" --children ${CHILDREN:-check time_gluon} 2>&1 |
        grep -E "kl (gluon|triton)|FAILED|bitwise_repeat\": false|finite\": false" |
        sed "s/^/$name: /" | cut -c1-300
    python - "$OUT/kl_$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for child, row in d["rows"].items():
    res = row.get("result", {})
    if child.startswith("check"):
        worst = {k: max(r["vs_triton"][k] for r in res.values()) for k in ("kl", "dq_idx", "dk_idx")} if res else {}
        rep = all(r["bitwise_repeat"] and r["finite"] for r in res.values())
        print(f"  {child}: {len(res)} cases, worst vs triton {worst}, repeat+finite {rep}, error {row.get('error')}")
PY
done
