#!/usr/bin/env python3
"""Held-out perplexity, mean L0 and the sparse/baseline ratio at each saved checkpoint of a
fine-tuning pair, from `twell eval --json` files named eval-RUN-step-N.json (and
eval-RUN.json for the final checkpoint).

usage: heldout_steps.py DIR SPARSE_RUN BASELINE_RUN
"""
import json
import re
import sys
from pathlib import Path


def evals(directory: Path, run: str) -> dict:
    """step (or 'final') -> (perplexity, mean L0 over layers) of one run's eval files."""
    found = {}
    for path in directory.rglob(f"eval-{run}*.json"):
        m = re.fullmatch(rf"eval-{re.escape(run)}(?:-step-(\d+))?\.json", path.name)
        if not m:
            continue
        d = json.loads(path.read_text())
        l0 = sum(layer["mean_l0"] for layer in d["layers"]) / len(d["layers"])
        found[int(m.group(1)) if m.group(1) else "final"] = (d["perplexity"]["perplexity"], l0)
    return found


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    directory, sparse_run, base_run = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    sparse, base = evals(directory, sparse_run), evals(directory, base_run)
    steps = sorted((s for s in sparse if s in base and s != "final"), key=int)
    if "final" in sparse and "final" in base:
        steps.append("final")
    if not steps:
        sys.exit(f"no checkpoint evaluated for both {sparse_run} and {base_run} under {directory}")
    print("| checkpoint | sparse ppl | sparse L0 | baseline ppl | ratio |")
    print("|---|---|---|---|---|")
    for s in steps:
        (sp, sl0), (bp, _) = sparse[s], base[s]
        print(f"| {s} | {sp:.2f} | {sl0:.1f} | {bp:.2f} | {sp / bp:.3f} |")


if __name__ == "__main__":
    main()
