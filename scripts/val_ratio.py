"""Validation perplexity of a sparse run against its lambda = 0 pair, step by step.

Usage: python3 scripts/val_ratio.py SPARSE.jsonl[.xz] BASELINE.jsonl[.xz]
Reads the `val_ce` records of two `twell finetune` logs and prints, at each step both
evaluated, the two perplexities, their ratio and the sparse run's mean L0.
"""
import json
import lzma
import math
import sys


def validation(path):
    opener = lzma.open if path.endswith(".xz") else open
    points = {}
    with opener(path, "rt") as f:
        for line in f:
            record = json.loads(line)
            if "val_ce" in record:
                points[record["step"]] = (math.exp(record["val_ce"]), record["mean_l0"])
    return points


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sparse, base = validation(sys.argv[1]), validation(sys.argv[2])
    print("| step | sparse ppl | L0 | lambda = 0 ppl | ratio |")
    print("|---|---|---|---|---|")
    for step in sorted(set(sparse) & set(base)):
        (s, l0), (b, _) = sparse[step], base[step]
        print(f"| {step} | {s:.2f} | {l0:.1f} | {b:.2f} | {s / b:.3f} |")


if __name__ == "__main__":
    main()
