#!/usr/bin/env bash
# job.sh LIMIT: two distilled gate-l0 fine-tunes side by side with annealed targets;
# each stops at LIMIT seconds with a step-N and resumes from it when run again.
set -u
limit=$1
. "$(dirname "$0")/../run-lib.sh"
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps 2400 --lr 2e-4 --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --time-limit $limit --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-density 0.025 --distill 0.5"
run anneal1600 --l1-target-anneal 1600
run anneal800 --l1-target-anneal 800
wait
for d in $out/*/; do n=$(basename $d); tail -n 1 $d/train_log.jsonl | head -c 700; echo; done
pack_logs
