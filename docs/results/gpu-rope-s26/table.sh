#!/bin/bash
# The 16 x 2048 prefill of every model-*.log here: tokens/s, ms and mJ/token of each path,
# the speed-up (dense ms / sparse ms) and the energy ratio (sparse mJ / dense mJ).
cd "$(dirname "$0")"
for f in model-*.log; do
  awk -v f="$f" '
    / prefill +16 +2048 +dense / {dt=$5; dm=$6; de=$(NF-1)}
    / prefill +16 +2048 +sparse / {st=$5; sm=$6; se=$(NF-1)}
    END {printf "| %s | %.0f | %.0f | %.3fx | %.3f | %.3f | %.3fx |\n", f, dt, st, dm/sm, de, se, se/de}' "$f"
done
