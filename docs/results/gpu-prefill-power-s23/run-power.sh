#!/bin/bash
# Session 23: power draw and SM clock during the prefill's energy windows, dense and
# sparse in processes of their own, sampled by nvidia-smi every 100 ms.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
cd .device/bin && xz -dc -T4 twell.xz > twell && chmod +x twell && cd ../..
R=$OUT/r; mkdir -p $R
T=.device/bin/twell
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE,TEMPERATURE > $R/nvidia-smi-q.txt 2>&1
grep -E "Power Limit|Max Clocks|SM  |Graphics" $R/nvidia-smi-q.txt | head -20
nvidia-smi --query-gpu=timestamp,power.draw,power.limit,enforced.power.limit,clocks.sm,clocks.mem,clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown,clocks_event_reasons.sw_thermal_slowdown,temperature.gpu --format=csv,nounits -lms 100 > $R/power-samples.csv 2>&1 &
SMI=$!
MODEL="--device cuda --dtype bf16 --shape 2048x5632x28 --heads 32 --vocab 49152 --density 0.005"
for round in 1 2; do
  for path in dense sparse; do
    echo "$path $round start $(date +%s.%N)" >> $R/windows.txt
    timeout 150 $T bench model $MODEL --ffn-paths $path --prefill 4x2048,16x2048 --decode-batch 1 --decode-steps 8 --train "" --reps 3 --warmup 1 --energy-secs 10 > $R/prefill-$path-$round.log 2>&1
    echo "$path $round end $(date +%s.%N) rc $?" >> $R/windows.txt
    grep -E "prefill" $R/prefill-$path-$round.log
  done
done
kill $SMI
cat $R/windows.txt
tar -C $OUT -cJf $OUT/r.tar.xz r
