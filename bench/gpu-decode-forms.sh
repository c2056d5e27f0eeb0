#!/usr/bin/env bash
# On a GPU machine: replayed decode steps (CUDA graphs) of Llama-family MLP shapes, 8 layers
# each, with the staged kernels at 2-64 rows forced to each form (`--staged-rows
# row-kernels|slot-kernels|spread-kernels`) and with the defaults, dense in the same process;
# prints the sparse/dense ratio of every cell (docs/benchmarks.md, "H100: 2-64 rows on the
# row kernels" and "H100: 2-64 rows spread over the card").
#   bench/gpu-decode-forms.sh TWELL [DENSITY...]     (default densities: 0.005 0.03)
# TWELL: a `twell` built with --features cuda. Logs and JSON go to $OUT (default /tmp/out).
# FORMS and SHAPES (hidden x d_ff : heads : kv heads) narrow the grid.
set -u
twell=${1:?usage: gpu-decode-forms.sh TWELL [DENSITY...]}
shift
densities=${*:-0.005 0.03}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-/usr/local/cuda/lib64}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# hidden x d_ff : heads : kv heads (head dim 64, the one the fused attention takes)
shapes=${SHAPES:-576x1536:9:3 896x4864:14:2 960x2560:15:5 1536x8960:24:4 2048x8192:32:8 3072x8192:48:8 4096x14336:64:8}
forms=${FORMS:-auto row-kernels slot-kernels spread-kernels}
for density in $densities; do
  for shape in $shapes; do
    IFS=: read -r hf heads kv <<< "$shape"
    for form in $forms; do
      log="$out/decode-forms-$hf-$density-$form"
      timeout 120 "$twell" bench model --device cuda --dtype bf16 --prefill '' --train '' \
        --context 512 --decode-steps 16 --reps 2 --warmup 1 --energy-secs 0 \
        --ffn-paths dense,sparse --decode-batch 2,4,8,16,32,64 --shape "${hf}x8" \
        --heads "$heads" --kv-heads "$kv" --density "$density" --staged-rows "$form" \
        --json "$log.json" > "$log.log" 2>&1 || echo "$hf $density $form: exit $?"
    done
  done
done
FORMS="$forms" python3 - "$out" <<'PY'
import glob, os, re, sys
out = sys.argv[1]
cells = {}
for path in glob.glob(f"{out}/decode-forms-*.log"):
    hf, density, form = re.match(r".*decode-forms-(\S+?)-([\d.]+)-(\S+)\.log", path).groups()
    for line in open(path):
        m = re.match(r"\s+decode-graph\s+(\d+)\s+\d+\s+(dense|sparse)\s+([\d.]+)", line)
        if m:
            cells.setdefault((hf, float(density), int(m[1])), {})[(form, m[2])] = float(m[3])
forms = os.environ["FORMS"].split()
print(f"{'shape':>11} {'density':>7} {'rows':>4} {'dense':>9} " + " ".join(f"{f:>12}" for f in forms))
for (hf, density, rows), c in sorted(cells.items(), key=lambda kv: (kv[0][1], int(kv[0][0].split('x')[0]), kv[0][2])):
    ratios = [c.get((f, "sparse"), float("nan")) / c.get((f, "dense"), float("nan")) for f in forms]
    dense = next((c[(f, "dense")] for f in forms if (f, "dense") in c), float("nan"))
    print(f"{hf:>11} {density * 100:6.1f}% {rows:>4} {dense:9.0f} "
          + " ".join(f"{r:12.2f}" for r in ratios))
PY
