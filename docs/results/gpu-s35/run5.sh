#!/bin/bash
# Session 35: the union kernels' build (7b7d902, .device/union/twell.xz) once more, for
# logs that come back: the row kernels, then the union kernels at NB 256 and 128, in
# turn, twice, 2,048 and 16,384 rows at 0.5 / 1 / 3% with the stages. Logs in one tarball.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
xz -dc -T4 .device/union/twell.xz > /tmp/twell && chmod +x /tmp/twell
R=/tmp/r; mkdir -p $R
for round in 1 2; do
  for path in rows union-256 union-128; do
    export TWELL_PREFILL=${path%%-*} TWELL_UNION_BLOCK=${path##*-}
    [ "$path" = rows ] && unset TWELL_UNION_BLOCK
    timeout 60 /tmp/twell bench mlp --device cuda --dtype bf16 --shape 2048x5632 \
      --tokens 2048,16384 --density 0.005,0.01,0.03 --reps 11 --warmup 3 --stages \
      > $R/mlp-$path-$round.log 2>&1
    echo "== $path round $round rc $?"; grep -E "stages" $R/mlp-$path-$round.log | head -6
  done
done
tar -C $R -cJf $OUT/mlp-union-s35.tar.xz .
