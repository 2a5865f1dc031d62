# Each finished load's wait on the host (protected until the GPU takes it) in a server log, with the prefill
# batches SGLang formed meanwhile: how full the GPU pool was, and how many requests were decoding.
# python protected_waits.py server-*.log   (TP>1 logs: rank 0 only)
import re, sys
for path in sys.argv[1:]:
    lines = open(path).read().splitlines()
    if "TP1]" in "".join(lines[:2000]):
        lines = [l for l in lines if "TP1]" not in l]
    prot = {}
    rows = []
    for i, l in enumerate(lines):
        m = re.search(r"policy: (\S+) load of \d+ tokens protected", l)
        if m: prot[m.group(1)] = i
        m = re.search(r"policy: (\S+) host protection of (\d+) tokens released after ([0-9.]+) s", l)
        if m and m.group(1) in prot:
            rid, tok, s = m.group(1), int(m.group(2)), float(m.group(3))
            j = prot.pop(rid)
            us, run, chunked = [], [], 0
            for b in lines[j:i]:
                mb = re.search(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), token usage: ([0-9.]+), #running-req: (\d+)", b)
                if mb:
                    us.append(float(mb.group(4))); run.append(int(mb.group(5))); chunked += 1
            rows.append((s, rid, tok, chunked, max(us) if us else None, max(run) if run else None))
    rows.sort(reverse=True)
    print(path.split('/')[-3] if '/' in path else path, "protected loads:", len(rows), " waited >= 0.3 s:", sum(r[0] >= 0.3 for r in rows))
    for r in rows:
        if r[0] >= 0.3:
            print(f"  {r[1]:18s} {r[2]:6d} tok waited {r[0]:.3f} s; prefill batches meanwhile {r[3]}, token usage max {r[4]}, running-req max {r[5]}")
