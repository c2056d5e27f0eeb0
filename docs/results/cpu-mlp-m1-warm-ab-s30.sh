#!/usr/bin/env bash
# Ten alternating rounds of one build: the rayon workers kept polling after one-token calls
# (TWELL_HOST_WARM_MS=20, the default) and not (=0). TWELL=path picks the binary.
for r in $(seq 1 10); do
  for w in 20 0; do
    echo -n "warm=$w "
    TWELL_HOST_WARM_MS=$w ${TWELL:-target/release/twell} bench mlp --shape 2048x5632 --tokens 1 --density 0.005,0.01,0.03 --weight-sets 8 --reps 21 --warmup 2 2>&1 | tail -3 | awk '{printf "%s:%s/%s/%s ", $4, $7, $8, $9} END {print ""}'
  done
done
