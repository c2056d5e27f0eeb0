#!/bin/bash
# Every prefill of every model-*.log here (the final build): the size, the process's
# TWELL_FOLD_NORMS (from the file name), dense and sparse tokens/s, the speed-up (dense
# ms / sparse ms), dense and sparse mJ/token and the energy ratio (sparse / dense).
# With an argument, the logs matching it instead (build1-*.log: the first build).
cd "$(dirname "$0")"
for f in ${1:-model-*.log}; do
  fold=${f##*fold}; fold=${fold%.log}
  awk -v f="$f" -v fold="$fold" '
    / prefill .* dense / {k=$2 "x" $3; dt[k]=$5; dm[k]=$6; de[k]=$(NF-1); order[++n]=k}
    / prefill .* sparse / {k=$2 "x" $3; st[k]=$5; sm[k]=$6; se[k]=$(NF-1)}
    END {for (i=1; i<=n; i++) {k=order[i];
      printf "| %s | %s | %s | %.0f | %.0f | %.3fx | %.3f | %.3f | %.3fx |\n", k, fold, f, dt[k], st[k], dm[k]/sm[k], de[k], se[k], se[k]/de[k]}}' "$f"
done | sort -t'|' -k2,2 -k3,3 -s
