#!/usr/bin/env bash
# Alternating rounds of two builds at one token: A (the screen's dot through vpmaddwd,
# $A) and B (through vpdpbusd on the token's two bytes, $B; tried, not kept: the B build
# was c626062 with that path added, not committed).
for r in $(seq 1 ${ROUNDS:-6}); do
  for b in A B; do
    bin=$A; [ $b = B ] && bin=$B
    echo -n "$b "
    $bin bench mlp --shape 2048x5632 --tokens 1 --density 0.005,0.01,0.03 --weight-sets 8 --reps 15 --warmup 2 2>&1 | tail -3 | awk '{printf "%s:%s/%s/%s ", $4, $7, $8, $9} END {print ""}'
  done
done
