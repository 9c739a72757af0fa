"""Run one distsgd dist training and sample per-thread CPU of every descendant process."""

import os
import sys
import threading
import time
from pathlib import Path

import distsgd

HZ = os.sysconf("SC_CLK_TCK")


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                try:
                    kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
                except OSError:
                    kids = []
                for k in kids:
                    out.append(int(k))
                    todo.append(int(k))
        except OSError:
            pass
    return out


def sample(pid):
    res = {}
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((e.decode()[5:] for e in env if e.startswith(b"RANK=")), "?")
        omp = next((e.decode() for e in env if e.startswith(b"OMP_NUM_THREADS=")), "-")
        for t in os.listdir(f"/proc/{pid}/task"):
            st = Path(f"/proc/{pid}/task/{t}/stat").read_text()
            comm = st[st.index("(") + 1 : st.rindex(")")]
            f = st[st.rindex(")") + 2 :].split()
            status = Path(f"/proc/{pid}/task/{t}/status").read_text()
            vcs = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
            int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            res[int(t)] = (comm, (int(f[11]) + int(f[12])) / HZ, vcs, int(f[7]))
        return {"cmd": cmd, "rank": rank, "omp": omp, "threads": res}
    except (OSError, ValueError, StopIteration):
        return None


seen = {}
stop = threading.Event()


def poll():
    me = os.getpid()
    while not stop.is_set():
        for p in descendants(me):
            s = sample(p)
            if s is not None:
                seen[p] = s
        time.sleep(0.1)


overrides = sys.argv[2:]
out = Path(sys.argv[1])
th = threading.Thread(target=poll, daemon=True)
th.start()
t0 = time.perf_counter()
r = distsgd.train(None, overrides=overrides, out_dir=out)
wall = time.perf_counter() - t0
stop.set()
th.join()
print(
    f"wall {wall:.2f}s train_wall_s {r['train_wall_s']:.3f} iterations {r['iterations']} s/it {r['train_wall_s'] / r['iterations'] * 1e3:.2f} ms"
)
for p, s in sorted(seen.items()):
    tot = sum(v[1] for v in s["threads"].values())
    print(
        f"pid {p} rank {s['rank']} {s['omp']} threads {len(s['threads'])} cpu {tot:.2f}s  {s['cmd'][:60]}"
    )
    for tid, (comm, cpu, v, nv) in sorted(s["threads"].items()):
        if cpu > 0.005 or v > 100:
            print(f"    {tid} {comm:16s} cpu {cpu:7.2f}s vcs {v:8d} minflt {nv:7d}")
