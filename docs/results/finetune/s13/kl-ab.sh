#!/usr/bin/env bash
# kl-ab.sh: the distilled fine-tuning step with the KL as candle ops (twell-ref: a build
# whose `kl_divergence` takes `kl_divergence_reference` on CUDA) against the fused KL op
# (twell: this commit), each run alone, alternating ref, fused, fused, ref; 60 steps of
# 8 x 512 tokens each. Compare the median tokens_per_sec of steps 11-60 per run.
set -u
export TWELL_DATA=/tmp/assets/data
out=/tmp/kl-ab; mkdir -p $out $OUT/kl-ab
for run in ref-1:/tmp/twell-ref fused-1:/tmp/twell fused-2:/tmp/twell ref-2:/tmp/twell-ref; do
  name=${run%%:*}; bin=${run#*:}
  $bin finetune --device cuda --dtype bf16 --ffn dense --seq-len 512 --batch 8 --steps 60 \
    --lr 2e-3 --warmup 20 --weight-decay 0.1 --distill 0.5 --l1 2e-3 --l1-warmup 50 \
    --l1-penalty gate-l0 --l1-target-density 0.024 --l1-target-anneal 800 \
    --eval-every 0 --eval-batches 1 --out $out/$name > $OUT/kl-ab/$name.log 2>&1
  cp $out/$name/train_log.jsonl $OUT/kl-ab/$name.jsonl
  python3 -c "
import json,sys
r=[json.loads(l) for l in open('$out/$name/train_log.jsonl')][10:]
t=sorted(x['tokens_per_sec'] for x in r); print('$name', len(r), 'median tokens/s', round(t[len(t)//2]))"
done
