#!/bin/bash
# Session 35: every kernel of the 2,048-row, 0.5% MLP bench in order with its time (ncu,
# real clocks), to see what runs besides the gate GEMM, pack, up and down.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/gpu/twell.xz > /tmp/twell && chmod +x /tmp/twell
timeout 200 ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum /tmp/twell bench mlp --device cuda \
  --dtype bf16 --shape 2048x5632 --tokens 2048 --density 0.005 --reps 2 --warmup 0 > $OUT/trace-2048.csv 2> $OUT/trace-2048.err
echo "rc $?"
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/trace-2048.csv")))
start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
head = rows[start]; k = head.index("Kernel Name"); t = head.index("gpu__time_duration.sum")
for r in rows[start + 2:]:
    if len(r) > t: print(f"{r[t]:>10}  {r[k][:110]}")
PY
