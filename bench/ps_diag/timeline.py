"""Summarise the records of sitecustomize.py (see README.md)."""

import json
import statistics
import sys
from pathlib import Path

d = Path(sys.argv[1])
recs = {}
for f in sorted(d.glob("rank*.jsonl")):
    r = f.name.split("-")[0]
    recs[r] = [json.loads(line) for line in f.read_text().splitlines()]


def med(xs):
    return statistics.median(xs) * 1e3 if xs else float("nan")


def mean(xs):
    return statistics.mean(xs) * 1e3 if xs else float("nan")


for r, v in recs.items():
    agg = {}
    for tag, t0, t1, cpu, th, size, _nt in v:
        key = (tag, th.split("-")[0] if th.startswith("ps-recv") else th, size > 100)
        agg.setdefault(key, []).append((t1 - t0, cpu))
    for k, xs in sorted(agg.items()):
        xs = xs[5:-5] or xs
        print(
            f"{r} {k[0]:12s} {k[1]:14s} big={k[2]!s:5s} n={len(xs):4d} wall med {med([x[0] for x in xs]):7.2f} mean {mean([x[0] for x in xs]):7.2f} | cpu med {med([x[1] for x in xs]):6.2f} mean {mean([x[1] for x in xs]):6.2f}"
        )
# learner 1 push timeline: push_pull start -> server recv(payload) end -> handle start -> send_weights end -> learner push_pull end
if "rank1" in recs and "rank0" in recs:
    pp = [(t0, t1) for tag, t0, t1, *_ in recs["rank1"] if tag == "push_pull"]
    srv = recs["rank0"]
    recv_big = sorted(t1 for tag, t0, t1, c, th, size, nt in srv if tag == "recv" and size > 100)
    handle = sorted(t0 for tag, t0, t1, *_ in srv if tag == "handle")
    sw = sorted((t0, t1) for tag, t0, t1, *_ in srv if tag == "send_weights")
    import bisect

    phases = {
        "push->srv payload recvd": [],
        "recvd->handle start": [],
        "handle->send_weights start": [],
        "send_weights": [],
        "sw end->learner has reply": [],
    }
    for a, b in pp[5:-5]:
        i = bisect.bisect_left(recv_big, a)
        if i >= len(recv_big):
            continue
        rv = recv_big[i]
        j = bisect.bisect_left(handle, rv)
        if j >= len(handle):
            continue
        h = handle[j]
        k = bisect.bisect_left(sw, (h, 0))
        if k >= len(sw):
            continue
        s0, s1 = sw[k]
        if not (a < rv < h < s0 < s1 <= b + 0.05):
            continue
        phases["push->srv payload recvd"].append(rv - a)
        phases["recvd->handle start"].append(h - rv)
        phases["handle->send_weights start"].append(s0 - h)
        phases["send_weights"].append(s1 - s0)
        phases["sw end->learner has reply"].append(b - s1)
    for k, xs in phases.items():
        print(f"timeline {k:28s} n={len(xs)} med {med(xs):7.2f} mean {mean(xs):7.2f}")
