#!/usr/bin/env bash
# job-eval.sh: held-out perplexity and density, a sample, and the dense-vs-TwELL model
# bench (prefill, decode, training step) of each finished run.
set -u
T=/tmp/twell; export TWELL_DATA=/tmp/assets/data
out=/tmp/runs; p=/tmp/pack; mkdir -p $p
for d in $out/*/; do
  n=$(basename $d); ck=$d/final
  [ -d $ck ] || { echo "no final for $n"; continue; }
  [ -e $p/eval-$n.json ] && continue
  cp $d/train_log.jsonl $p/$n.jsonl
  $T eval --device cuda --model $ck --last 10 --json $p/eval-$n.json --svg $p/eval-$n.svg > $p/eval-$n.log 2>&1
  tail -n 5 $p/eval-$n.log
  $T generate --device cuda --model $ck --ffn ${GEN_FFN:-sparse} --max-tokens 80 \
    -p "Mr. Speaker, Mr. Vice President, members of Congress, my fellow Americans:" > $p/generate-$n.txt 2>&1
  tail -c 700 $p/generate-$n.txt; echo
done
best=$(ls -d $out/*/final | head -1)
[ "${BENCH:-1}" = 1 ] && $T bench model --device cuda --dtype bf16 --model $best --prefill 4x512 --decode-batch 1 \
  --context 512 --decode-steps 8 --train 8x512 --reps 3 --json $p/bench-model.json > $p/bench-model.log 2>&1
tail -n 15 $p/bench-model.log
tar cJf $OUT/eval.tar.xz -C $p .
