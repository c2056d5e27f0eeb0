#!/usr/bin/env bash
# `twell serve` under load, dense default against sparse default: for each, starts the
# server on a loopback port, runs `twell bench serve` (streamed chat requests at each
# concurrency, temperature 0.7), stops it. Prints a table and where each engine spent its
# time (prefill, decode, sample, emit); JSON and /metrics under OUT.
#   OUT=/tmp/serve-load bench/serve-load.sh [TWELL FLAGS...]     e.g. --device cuda
# CONCURRENCY (default 1,8,32,64), ROUNDS (2), WARMUP_ROUNDS (1, untimed, before each
# level), MAX_TOKENS (32); TWELL names the binary.
# Needs scripts/setup.sh (the model).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
twell=${TWELL:-target/release/twell}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
for model in dense sparse; do
  flags=()
  [ "$model" = dense ] && flags=(--dense)
  "$twell" serve "${flags[@]}" "$@" --port 0 --max-sequences 64 --queue 256 2>"$out/$model-server.log" &
  pid=$!
  for _ in $(seq 1 600); do
    grep -q "http://" "$out/$model-server.log" 2>/dev/null && break
    sleep 0.2
  done
  url=$(grep -o "http://[^ ]*/v1" "$out/$model-server.log")
  "$twell" bench serve "$url" \
    --concurrency "${CONCURRENCY:-1,8,32,64}" --rounds "${ROUNDS:-2}" \
    --warmup-rounds "${WARMUP_ROUNDS:-1}" \
    --max-tokens "${MAX_TOKENS:-32}" --json "$out/$model.json" > /dev/null
  curl -s "${url%/v1}/metrics" > "$out/$model-metrics.txt"
  kill -TERM "$pid"; wait "$pid" || true
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
d, s = (json.load(open(f"{out}/{m}.json")) for m in ("dense", "sparse"))
print("concurrency | dense tok/s | sparse tok/s | ratio | TTFT p50 dense / sparse (s) | TTFT p99 dense / sparse (s)")
for a, b in zip(d, s):
    print(f"{a['concurrency']:>11} | {a['tokens_per_sec']:11.1f} | {b['tokens_per_sec']:12.1f} | {b['tokens_per_sec'] / a['tokens_per_sec']:5.2f}x | "
          f"{a['ttft_p50_secs']:.3f} / {b['ttft_p50_secs']:.3f} | {a['ttft_p99_secs']:.3f} / {b['ttft_p99_secs']:.3f}")
# Where each engine's time went over the whole run (its /metrics at the end).
for m in ("dense", "sparse"):
    phases = {}
    for line in open(f"{out}/{m}-metrics.txt"):
        if line.startswith("twell_engine_seconds_total{"):
            phases[line.split('"')[1]] = float(line.split()[-1])
    total = sum(phases.values()) or 1.0
    print(f"{m} engine: " + ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in phases.items()))
PY
