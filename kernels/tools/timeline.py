#!/usr/bin/env python3
"""Per-step kernel time from a cupti_trace.c CSV (issue 12's measuring instrument).

usage: timeline.py TRACE.csv [--last N] [--end REGEX] [--launches] [--mem]

A step ends with the sampling kernel (--end). Of the last N steps (default 32), each kernel is
charged its exclusive time: from the previous kernel's end (or its own start, if later) to its
own end, so the charges of a step add up to the step's GPU span and a programmatic dependent
launch that starts early is charged only for what it adds. `idle` is GPU time with no kernel
running between two kernels of a step, `host` the gap between steps (the host's part of the
token loop). Prints one table, kernels by their share of the step; with --launches a second one,
every launch of a step in order (a kernel's k-th launch of a step matched across steps, the
median over them) with its grid: which matrix a GEMV's time goes to."""
import collections
import csv
import re
import sys

args = sys.argv[1:]
path = args[0]
last = int(args[args.index("--last") + 1]) if "--last" in args else 32
end_re = re.compile(args[args.index("--end") + 1] if "--end" in args else r"sample_greedy_final|argmax_final_f32|sample_rows")
rows = []
with open(path) as f:
    for r in csv.DictReader(f):
        # Copies and memsets only with --mem (a memcpy's "grid" is its byte count): they sit
        # between kernels in stream order and break the chain of early-launched kernels.
        if r["name"].startswith("mem") and "--mem" not in args:
            continue
        rows.append((int(r["start"]), int(r["end"]), r["name"], r["gx"], r["gy"], r["gz"]))
rows.sort(key=lambda r: r[0])
steps, cur = [], []
for r in rows:
    cur.append(r)
    if end_re.search(r[2]):
        steps.append(cur)
        cur = []
steps = steps[-(last + 1):]
if len(steps) < 2:
    sys.exit("fewer than two steps in the trace")
excl = collections.defaultdict(float)
dur = collections.defaultdict(float)
cnt = collections.Counter()
idle = host = span = 0.0
per_launch = collections.defaultdict(list)
grids = {}
order = []
prev_end = steps[0][-1][1]
for st in steps[1:]:
    host += max(0, st[0][0] - prev_end)
    t = max(prev_end, st[0][0])
    first = True
    seen = collections.Counter()
    for (s, e, name, gx, gy, gz) in st:
        key = re.sub(r"<.*", "", name)
        seen[key] += 1
        occ = (key, seen[key])
        if not first and s > t:
            idle += s - t
        first = False
        start = max(s, t)
        excl[key] += max(0, e - start)
        per_launch[occ].append((max(0, e - start), e - s))
        if occ not in grids:
            grids[occ] = "%s,%s,%s" % (gx, gy, gz)
            order.append(occ)
        dur[key] += e - s
        cnt[key] += 1
        t = max(t, e)
    span += t - max(prev_end, st[0][0])
    prev_end = t
n = len(steps) - 1
wall = (prev_end - steps[0][-1][1]) / n / 1e3
print("steps %d, wall %.1f us a step (%.1f tok/s at one token a step), GPU span %.1f, idle inside %.1f, host gaps %.1f" % (
    n, wall, 1e6 / wall if wall else 0, span / n / 1e3, idle / n / 1e3, host / n / 1e3))
print("%-44s %6s %9s %9s %6s" % ("kernel", "n/step", "excl us", "dur us", "share"))
for k, v in sorted(excl.items(), key=lambda kv: -kv[1]):
    print("%-44s %6.1f %9.1f %9.1f %5.1f%%" % (k[:44], cnt[k] / n, v / n / 1e3, dur[k] / n / 1e3, 100 * v / n / 1e3 / wall))
if "--launches" in args:
    def median(v):
        v = sorted(v)
        return v[len(v) // 2] if v else 0.0
    print()
    print("%-4s %-36s %3s %-16s %5s %9s %9s" % ("#", "kernel", "k", "grid", "steps", "excl us", "dur us"))
    for i, occ in enumerate(order):
        v = per_launch[occ]
        print("%-4d %-36s %3d %-16s %5d %9.2f %9.2f" % (
            i, occ[0][:36], occ[1], grids[occ], len(v), median([a for a, _ in v]) / 1e3, median([b for _, b in v]) / 1e3))
