#!/usr/bin/env bash
# job.sh LIMIT LR...: distilled fine-tunes side by side (the eleventh session's recipe:
# α 0.5, gate-l0 annealed over 800 steps, 2,400 × 8 × 512, bf16), one pair per learning
# rate: gate-l0 aimed at 2.4% and its λ = 0 twin; each run stops at LIMIT seconds with a step-N and
# resumes from it when run again. STEPS (default 2,400) shortens the schedule (the
# thirteenth session: 2,000 and 3,000). SEED (default 0) sets the order in which the
# training sequences are visited; a seed other than 0 names the runs `...-seedN` (the
# fourteenth session's repeat). Held-out evaluation and samples: ../s10/job-eval.sh.
set -u
limit=$1; shift
. "$(dirname "$0")/../run-lib.sh"
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-2400} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit --seed ${SEED:-0}"
tag=${SEED:+-seed$SEED}; [ "${SEED:-0}" = 0 ] && tag=""
sparse="--l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 800 --l1-target-density 0.024"
for lr in "$@"; do
  run relu-lr$lr$tag --lr $lr --l1 0
  run lr$lr-t024$tag --lr $lr $sparse
done
wait
pack_logs
