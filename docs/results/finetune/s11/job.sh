#!/usr/bin/env bash
# job.sh LIMIT: two distilled gate-l0 fine-tunes side by side (the tenth session's best
# recipe, anneal 800, with one change each); each stops at LIMIT seconds with a step-N
# and resumes from it when run again.
set -u
limit=$1
T=/tmp/twell; export TWELL_DATA=/tmp/assets/data
out=/tmp/runs; mkdir -p $out
common="--device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps 2400 --warmup 20 --weight-decay 0.1 --eval-every 100 --eval-batches 8 --save-every 500 --time-limit $limit --l1 2e-3 --l1-warmup 50 --l1-penalty gate-l0 --l1-target-density 0.025 --l1-target-anneal 800"
run() {
  local name=$1; shift
  [ -d $out/$name/final ] && return
  local resume=() last
  last=$(ls -d $out/$name/step-* 2>/dev/null | sort -V | tail -1)
  [ -n "$last" ] && resume=(--resume "$last")
  $T finetune $common "$@" ${resume[@]+"${resume[@]}"} --out $out/$name >> $out/$name.log 2>&1 &
}
run lr6e-4 --lr 6e-4 --distill 0.5
run kl-only --lr 2e-4 --distill 1.0
wait
for f in $out/*.log; do echo "== $f"; tail -c 600 $f; echo; done
mkdir -p /tmp/pack; for d in $out/*/; do n=$(basename $d); cp $d/train_log.jsonl /tmp/pack/$n.jsonl; cp $out/$n.log /tmp/pack/; done
tar cJf $OUT/logs.tar.xz -C /tmp/pack .
