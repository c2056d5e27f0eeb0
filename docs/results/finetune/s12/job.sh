#!/usr/bin/env bash
# job.sh LIMIT LR...: distilled fine-tunes side by side (the eleventh session's recipe:
# α 0.5, gate-l0 annealed over 800 steps, 2,400 × 8 × 512, bf16), one pair per learning
# rate: gate-l0 aimed at 2.4% and its λ = 0 twin; each run stops at LIMIT seconds with a step-N and
# resumes from it when run again. STEPS (default 2,400) shortens the schedule (the
# thirteenth session: 2,000). Held-out evaluation and samples: ../s10/job-eval.sh.
set -u
limit=$1; shift
T=/tmp/twell; export TWELL_DATA=/tmp/assets/data
out=/tmp/runs; mkdir -p $out
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps ${STEPS:-2400} --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --distill 0.5 --time-limit $limit"
sparse="--l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-anneal 800 --l1-target-density 0.024"
run() {
  local name=$1; shift
  [ -d $out/$name/final ] && return
  local resume=() last
  last=$(ls -d $out/$name/step-* 2>/dev/null | sort -V | tail -1)
  [ -n "$last" ] && resume=(--resume "$last")
  $T finetune $common "$@" ${resume[@]+"${resume[@]}"} --out $out/$name >> $out/$name.log 2>&1 &
}
for lr in "$@"; do
  run relu-lr$lr --lr $lr --l1 0
  run lr$lr-t024 --lr $lr $sparse
done
wait
for f in $out/*.log; do echo "== $f"; tail -c 400 $f; echo; done
mkdir -p /tmp/pack; for d in $out/*/; do n=$(basename $d); cp $d/train_log.jsonl /tmp/pack/$n.jsonl; cp $out/$n.log /tmp/pack/; done
tar cJf $OUT/logs.tar.xz -C /tmp/pack .
