"""Power draw and SM clock of each bench process in run-power.sh, from nvidia-smi's
100 ms samples: the first stretch above 450 W is the prefill (4 x 2048, then 16 x 2048,
about ten seconds each), split in halves by time."""
import csv, datetime, lzma, statistics, sys

def samples(path):
    rows = list(csv.reader(lzma.open(path, "rt")))[1:]
    out = []
    for r in rows:
        ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
        ts = ts.replace(tzinfo=datetime.timezone.utc).timestamp()
        out.append((ts, float(r[1]), float(r[4]), r[6].strip() == "Active"))
    return out

def first_high_stretch(window):
    stretch = []
    for s in window:
        if s[1] > 450:
            stretch.append(s)
        elif len(stretch) > 20:
            return stretch
        else:
            stretch = []
    return stretch

def describe(part):
    return "%4.1f s  %3.0f W  %4.0f MHz  power cap %3.0f%%" % (
        part[-1][0] - part[0][0],
        statistics.median(s[1] for s in part),
        statistics.median(s[2] for s in part),
        100 * sum(s[3] for s in part) / len(part),
    )

data = samples(sys.argv[1] if len(sys.argv) > 1 else "power-samples.csv.xz")
windows = {}
for line in open("windows.txt"):
    path, rnd, edge, t = line.split()[:4]
    windows.setdefault((path, rnd), {})[edge] = float(t)
for (path, rnd), w in windows.items():
    stretch = first_high_stretch([s for s in data if w["start"] <= s[0] <= w["end"]])
    mid = stretch[0][0] + (stretch[-1][0] - stretch[0][0]) / 2
    first = [s for s in stretch if s[0] < mid]
    second = [s for s in stretch if s[0] >= mid]
    print(f"{path:6} {rnd}  first half (4 x 2048): {describe(first)} | second (16 x 2048): {describe(second)}")
