#!/bin/bash
# Prints the pack stage (ms) and the speed-up of each call-1 stage log, one row per (M, density):
# bash pack_table.sh (from this folder).
for f in call1-stages-*.log; do
  awk -v run="${f#call1-stages-}" '/^ +2048 +5632/ {m=$3; dens=$5; sp=$9} /stages ms/ {print m, dens, run, $7, sp}' "$f"
done | sort -k2,2 -k1,1n -k3,3 | awk 'BEGIN{print "| M | density | run | pack ms | speed-up |"; print "|---|---|---|---|---|"} {printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5}'
