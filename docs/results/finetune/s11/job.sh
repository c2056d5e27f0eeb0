#!/usr/bin/env bash
# job.sh LIMIT SET: two distilled gate-l0 fine-tunes side by side (the tenth session's best
# recipe: target 2.5% annealed over 800 steps), each stopping at LIMIT seconds with a
# step-N and resuming from it when run again.
#   SET 1: lr 6e-4; and lr 2e-4 with the teacher's KL alone (--distill 1.0)
#   SET 2: the λ = 0 run at lr 6e-4; and lr 6e-4 aimed at 2.4%
# Held-out evaluation and samples: ../s10/job-eval.sh.
set -u
limit=$1 set=$2
. "$(dirname "$0")/../run-lib.sh"
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps 2400 --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --time-limit $limit"
sparse="--l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 800"
if [ "$set" = 1 ]; then
  run lr6e-4 --lr 6e-4 --distill 0.5 $sparse --l1-target-density 0.025
  run kl-only --lr 2e-4 --distill 1.0 $sparse --l1-target-density 0.025
else
  run relu-lr6e-4 --lr 6e-4 --distill 0.5 --l1 0
  run lr6e-4-t024 --lr 6e-4 --distill 0.5 $sparse --l1-target-density 0.024
fi
wait
pack_logs
