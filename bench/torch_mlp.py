"""Dense PyTorch (cuBLAS) baseline of one ReGLU MLP layer, to show candle's dense path is no strawman.

Run on the GPU machine:  python3 bench/torch_mlp.py --tokens 1,2048,16384,65536 --json out.json
Same shapes and dtype as `twell bench mlp --device cuda --dtype bf16`; times with CUDA events,
median of repeated runs after warm-up, rotating two weight sets.

With --train, a training step of the layer as `twell bench mlp-train` times it: forward, the
loss (row sums, then their f32 total) and backward into x and the three weights.
"""
import argparse
import json
import statistics

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2048x5632")
    ap.add_argument("--tokens", default="1,2048,16384,65536")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--train", action="store_true", help="time forward + backward")
    args = ap.parse_args()
    hidden, ffn = (int(v) for v in args.shape.split("x"))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sets = [
        tuple((torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_(args.train)
              for shape in [(ffn, hidden), (ffn, hidden), (hidden, ffn)])
        for _ in range(2)
    ]
    rows = []
    for m in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16).requires_grad_(args.train)

        def mlp(k):
            wg, wu, wd = sets[k % 2]
            out = (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T
            if args.train:
                out.sum(-1).float().sum().backward()
                for t in (x, wg, wu, wd):
                    t.grad = None
            return out

        for k in range(3):
            mlp(k)
        torch.cuda.synchronize()
        times = []
        for k in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            mlp(k)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        flops = (18 if args.train else 6) * m * hidden * ffn
        row = {"hidden": hidden, "ffn": ffn, "tokens": m, "train": args.train, "torch_dense_ms": ms,
               "tflops": flops / ms / 1e9, "weight_gbps": 3 * hidden * ffn * 2 / ms / 1e6}
        rows.append(row)
        what = "train step" if args.train else "forward"
        print(f"torch dense {what} M={m:>6}  {ms:8.4f} ms  {row['tflops']:7.1f} TFLOP/s  {row['weight_gbps']:7.1f} GB/s (weights)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
