"""The suite's tables, targets and plot, from its results JSON (`suite.py`); rerun on a results
file with ``python benchmarks/e2e/suite_report.py <out>/suite-<shape>.json [--plot]``."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2elib import _jsonable  # noqa: E402
from open_loop_bound import pair_open_reps  # noqa: E402

SGLANG_GDS = ("gds-wait_complete", "gds-best_effort", "gds-timeout")
OURS = "gds-compute_or_load"


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else math.nan


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.fmean(xs) if xs else math.nan


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ttfts(cell: dict[str, Any]) -> list[float]:
    return [r["ttft_s"] for r in cell["results"] if r.get("error") is None and r.get("ttft_s") is not None]


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    cells = [c for c in doc.get("cells", {}).values() if "results" in c]
    paired, unpaired = pair_open_reps(cells)
    cells = [c for c in cells if c["workload"] != "open" or c["rep"] in paired[c["rate"]]]
    by: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        by[(c["workload"], c["config"]) + ((c["rate"],) if c["workload"] == "open" else ())].append(c)
    out: dict[str, Any] = {"single": {}, "burst": {}, "open": {}, "host": {}, "tokens": {}, "open_unpaired": unpaired}
    for key, cs in by.items():
        w, cfg = key[0], key[1]
        split = {k: _mean([c["stats"]["split"][k] for c in cs]) for k in ("device", "host", "storage", "computed")}
        frac = _mean([c["stats"]["storage_frac"] for c in cs])
        if w == "host":
            t = [x for c in cs for x in _ttfts(c)]
            out["host"][cfg] = {"reps": len(cs), "median": _med(t), "ttfts": t, "split": split}
        elif w == "single":
            per_rep = [_mean(_ttfts(c)) for c in cs]
            per_prompt: dict[str, list[float]] = defaultdict(list)
            for c in cs:
                for r in c["results"]:
                    if r.get("error") is None:
                        per_prompt[r["tag"]].append(r["ttft_s"])
            out["single"][cfg] = {"reps": len(cs), "mean": _mean([t for c in cs for t in _ttfts(c)]),
                                  "p90": _pct([t for c in cs for t in _ttfts(c)], 90),
                                  "rep_means": per_rep, "per_prompt_median": {k: _med(v) for k, v in per_prompt.items()},
                                  "storage_frac": frac, "split": split}
        elif w == "burst":
            ms = [c["stats"]["makespan_s"] for c in cs]
            out["burst"][cfg] = {"reps": len(cs), "makespan": _med(ms), "makespans": ms,
                                 "mean_ttft": _med([c["stats"]["mean"] for c in cs]),
                                 "p50": _pct([t for c in cs for t in _ttfts(c)], 50),
                                 "p90": _pct([t for c in cs for t in _ttfts(c)], 90),
                                 "p99": _pct([t for c in cs for t in _ttfts(c)], 99),
                                 "output_tok_s": _med([c["stats"]["output_tok_s"] for c in cs]), "storage_frac": frac,
                                 "split": split}
        else:
            t = [x for c in cs for x in _ttfts(c)]
            out["open"].setdefault(cfg, {})[key[2]] = {
                "reps": len(cs), "p50": _pct(t, 50), "p90": _pct(t, 90), "p99": _pct(t, 99), "mean": _mean(t),
                "makespan": _med([c["stats"]["makespan_s"] for c in cs]),
                "output_tok_s": _med([c["stats"]["output_tok_s"] for c in cs]), "storage_frac": frac, "split": split}
    # greedy tokens against recompute's, prompt by prompt (the measured visits' prompts are identical)
    ref: dict[str, list[int]] = {}
    for c in cells:
        if c["config"] == "recompute":
            for r in c["results"]:
                if r.get("error") is None and r.get("output_ids"):
                    ref.setdefault(r["tag"], r["output_ids"])
    for c in cells:
        if c["config"] == "recompute":
            continue
        t = out["tokens"].setdefault(c["config"], {"compared": 0, "identical": 0})
        for r in c["results"]:
            if r["tag"] in ref and r.get("error") is None:
                t["compared"] += 1
                t["identical"] += int(r.get("output_ids") == ref[r["tag"]])
    out["targets"] = targets(out, doc)
    out["breakeven"] = breakeven(out, doc, cells)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else math.nan


def targets(s: dict[str, Any], doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 20's targets, where this run has the numbers for them."""
    big = (doc.get("model") or {}).get("kv_bytes_per_token", 0) >= 200 * 1024  # the 32B shape
    rows = []

    def add(name: str, value: float, limit: float, how: str) -> None:
        rows.append({"target": name, "value": value, "limit": limit, "met": value == value and value <= limit,
                     "how": how})

    sg, bu, op = s["single"], s["burst"], s["open"]
    if OURS in sg and "recompute" in sg and "gds-wait_complete" in sg:
        best = min(sg["recompute"]["mean"], sg["gds-wait_complete"]["mean"])
        add("one at a time: mean TTFT vs min(recompute, gds wait_complete)", _ratio(sg[OURS]["mean"], best), 1.05,
            "mean over prompts and repetitions")
    if OURS in bu and "recompute" in bu:
        add("burst: makespan vs recompute", _ratio(bu[OURS]["makespan"], bu["recompute"]["makespan"]),
            0.65 if big else 0.8, "medians over repetitions")
        if big:
            add("burst: mean TTFT vs recompute", _ratio(bu[OURS]["mean_ttft"], bu["recompute"]["mean_ttft"]), 0.6,
                "medians over repetitions")
    if OURS in op and "recompute" in op:
        rates = sorted(op["recompute"])
        # The idle value is recompute's p90 with the server idle: one at a time where this
        # run measured it, else its lowest rate (which may already queue).
        if "recompute" in sg:
            idle, idle_at = sg["recompute"]["p90"], "its one-at-a-time p90"
        else:
            idle, idle_at = (op["recompute"][rates[0]]["p90"] if rates else math.nan), f"its {rates[0]:g} req/s p90"
        knee = next((r for r in rates if op["recompute"][r]["p90"] >= 2 * idle), None)
        if knee is not None and knee in op[OURS]:
            add(f"open loop at {knee:g} req/s (recompute p90 >= 2x {idle_at}): p90 vs recompute",
                _ratio(op[OURS][knee]["p90"], op["recompute"][knee]["p90"]), 0.6, "pooled over repetitions")
        else:
            rows.append({"target": f"open loop: recompute p90 never reached 2x {idle_at} over the rates run",
                         "value": math.nan, "limit": 0.6, "met": None, "how": "raise --rates"})
    if "gds-wait_complete" in sg and "nixl" in sg:
        a, b = sg["gds-wait_complete"]["per_prompt_median"], sg["nixl"]["per_prompt_median"]
        common = sorted(set(a) & set(b))
        if common:
            add(f"revisit from L3: gds vs HiCacheNixl (wait_complete; medians of {min(sg['nixl']['reps'], sg['gds-wait_complete']['reps'])} "
                "repetitions, interleaved)", _ratio(_mean([a[k] for k in common]), _mean([b[k] for k in common])), 1.0,
                "mean over prompts of per-prompt medians")
    for w, metric in (("single", "mean"), ("burst", "makespan")):
        src = s[w]
        own = [c for c in SGLANG_GDS if c in src]
        if OURS in src and own:
            best = min(src[c][metric] for c in own)
            add(f"{w}: vs the best of SGLang's policies with gds ({', '.join(c[4:] for c in own)})",
                _ratio(src[OURS][metric], best), 1.0, metric)
    for cfg, t in s["tokens"].items():
        rows.append({"target": f"greedy tokens = recompute ({cfg})", "value": t["identical"], "limit": t["compared"],
                     "met": t["compared"] > 0 and t["identical"] == t["compared"], "how": "prompt by prompt"})
    return rows


def breakeven(s: dict[str, Any], doc: dict[str, Any], cells: list[dict]) -> dict[str, Any]:
    kv = (doc.get("model") or {}).get("kv_bytes_per_token")
    raw = doc.get("raw_disk") or {}
    read = next((j.get("raw_MBps") for j in raw.values() if isinstance(j, dict) and j.get("rw") == "read"), None)
    rates = [r["prompt_tokens"] / r["ttft_s"] for c in cells if c["config"] == "recompute" and c["workload"] == "single"
             for r in c["results"] if r.get("error") is None and r.get("ttft_s")]
    out = {"kv_bytes_per_token": kv, "raw_read_MBps": read, "prefill_tok_s": _med(rates)}
    if kv and read:
        out["breakeven_prefill_tok_s"] = read * 1e6 / kv
    return out


def _f(x: Any, unit: str = "", nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{nd}f}{unit}"


def _split(sp: dict[str, float]) -> str:
    return " / ".join(f"{sp[k] / 1000:.0f}k" for k in ("device", "host", "storage", "computed"))


def markdown(doc: dict[str, Any], s: dict[str, Any], extra: Any = ()) -> str:
    """The report; `extra` (lines) goes before the targets."""
    a, m = doc.get("args", {}), doc.get("model", {})
    lines = [f"# Compute or load: {m.get('name')} ({m.get('kv_bytes_per_token', 0) // 1024} KiB of KV per token), "
             f"TP={a.get('tp', 1)}, {doc.get('machine')}", "",
             f"{m.get('layers')} layers, {m.get('attention', 'mha')} attention"
             + (", one latent per token and layer: rank 0 writes the L3, every rank reads it"
                if m.get('attention') == "mla" else "")
             + (f", {m['quantization']} weights" if m.get("quantization") else ""), "",
             f"sglang {doc.get('versions', {}).get('sglang')}, one server, configurations switched at runtime; "
             f"page {a.get('page_size')}, GPU pool {a.get('max_total_tokens')} tokens, host pool x{a.get('hicache_ratio')}, "
             f"chunk {a.get('chunk')}, {a.get('gen')} greedy tokens per request; prompts "
             f"{doc.get('lengths', [0])[0]}-{doc.get('lengths', [0])[-1]} tokens (+{a.get('suffix_tokens')})", ""]
    be = s["breakeven"]
    if be.get("raw_read_MBps"):
        lines += [f"Disk (same run): raw O_DIRECT read {be['raw_read_MBps']:.0f} MB/s; prefill measured "
                  f"{_f(be.get('prefill_tok_s'), '', 0)} tokens/s (recompute, one at a time); L3 pays one request at "
                  f"a time when prefill is slower than {_f(be.get('breakeven_prefill_tok_s'), '', 0)} tokens/s "
                  "(attention moves it further for long prompts).", ""]
    if s["single"]:
        lines += ["## One at a time", "", "| config | mean TTFT | per-repetition means | storage | device / host / "
                  "storage / computed tokens | per prompt (median) |", "|---|---|---|---|---|---|"]
        for cfg, v in s["single"].items():
            pp = ", ".join(f"{k} {_f(t)}" for k, t in sorted(v["per_prompt_median"].items()))
            lines.append(f"| {cfg} | {_f(v['mean'], ' s')} | {', '.join(_f(x) for x in v['rep_means'])} | "
                         f"{v['storage_frac']:.0%} | {_split(v['split'])} | {pp} |")
        lines.append("")
    if s.get("host"):
        base = s["host"].get("recompute", {}).get("median")
        lines += ["## A host-only hit (the L3 serves nothing)", "", "| config | TTFT median (all) | vs recompute "
                  "(L3 detached) | device / host / storage / computed |", "|---|---|---|---|"]
        for cfg, v in s["host"].items():
            lines.append(f"| {cfg} | {_f(v['median'], ' s')} ({', '.join(_f(x) for x in v['ttfts'])}) | "
                         f"{_f((v['median'] - base) * 1e3, ' ms', 1) if base else '-'} | {_split(v['split'])} |")
        lines.append("")
    if s["burst"]:
        lines += ["## Burst", "", "| config | makespan (median; all) | vs recompute | mean TTFT | TTFT p50 / p90 / p99 | "
                  "output tok/s | storage | device / host / storage / computed |", "|---|---|---|---|---|---|---|---|"]
        base = s["burst"].get("recompute", {}).get("makespan")
        for cfg, v in s["burst"].items():
            lines.append(f"| {cfg} | {_f(v['makespan'], ' s', 2)} ({', '.join(_f(x, '', 2) for x in v['makespans'])}) | "
                         f"{_f(_ratio(v['makespan'], base), 'x', 2)} | {_f(v['mean_ttft'], ' s', 2)} | "
                         f"{_f(v['p50'], '', 2)} / {_f(v['p90'], '', 2)} / {_f(v['p99'], '', 2)} s | "
                         f"{_f(v['output_tok_s'], '', 1)} | {v['storage_frac']:.0%} | {_split(v['split'])} |")
        lines.append("")
    if s["open"]:
        lines += ["## Open loop (Poisson arrivals)", "", "| config | rate (req/s) | TTFT p50 / p90 / p99 | makespan | "
                  "output tok/s | storage |", "|---|---|---|---|---|---|"]
        for cfg, by_rate in s["open"].items():
            for rate, v in sorted(by_rate.items()):
                lines.append(f"| {cfg} | {rate:g} | {_f(v['p50'], '', 2)} / {_f(v['p90'], '', 2)} / {_f(v['p99'], '', 2)}"
                             f" s | {_f(v['makespan'], ' s', 1)} | {_f(v['output_tok_s'], '', 1)} | "
                             f"{v['storage_frac']:.0%} |")
        lines.append("")
        if s["open_unpaired"]:
            lines += [f"Left out, their repetition not measured for every configuration at that rate: "
                      f"{', '.join(s['open_unpaired'])}.", ""]
    lines += list(extra)
    if s["targets"]:
        lines += ["## Targets (issue 20)", "", "| target | value | limit | met |", "|---|---|---|---|"]
        for t in s["targets"]:
            met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
            val = t["value"] if isinstance(t["value"], int) else _f(t["value"], "", 2)
            lines.append(f"| {t['target']} | {val} | {t['limit']} | {met} |")
        lines.append("")
    calls = doc.get("calls", [])
    lines += ["Calls: " + "; ".join(f"{c.get('started')} start {c.get('start_s')} s, {len(c.get('cells', []))} "
                                    f"measurements, {c.get('seconds')} s{' ERROR ' + c['error'] if c.get('error') else ''}"
                                    for c in calls)]
    return "\n".join(lines) + "\n"


def plot_p90(s: dict[str, Any], path: str, title: str) -> str | None:
    """TTFT p90 against arrival rate, one line per configuration (matplotlib, the `plot` extra)."""
    if not s["open"]:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for cfg, by_rate in sorted(s["open"].items()):
        rates = sorted(by_rate)
        ax.plot(rates, [by_rate[r]["p90"] for r in rates], marker="o", label=cfg)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(doc: dict[str, Any], out: str, shape: str, plot: bool = False, bound: bool = False) -> dict[str, Any]:
    """`<out>/suite-<shape>.md` (and the plot); `bound` adds the ideal server's section (`bound_lines`:
    seconds of simulation, so the suite leaves it to a rerun of this script)."""
    d = _jsonable(doc)
    s = summarize(d)
    with open(os.path.join(out, f"suite-{shape}.md"), "w") as f:
        f.write(markdown(d, s, bound_lines(d, s) if bound else ()))
    if plot:
        plot_p90(s, os.path.join(out, f"suite-{shape}-ttft-p90.png"), f"{shape}: TTFT p90 against load")
    return s


def bound_lines(doc: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """The burst and the open loop set against the run's ideal server (`open_loop_bound`): what
    per-request load or compute reaches on the same arrivals (and, for the open loop,
    at the knee), and what computing a head while loading the rest would. Empty without either
    workload; a line saying why where the run lacks what the model needs (recompute one at a time,
    the raw read rate)."""
    import open_loop_bound as olb
    if not s["open"] and not s["burst"]:
        return []
    head = ["## Against the ideal server", ""]
    try:
        srv, lengths = olb.from_run(doc)
    except ValueError as exc:
        return head + [f"Not computed: {exc}.", ""]
    lines = head + [
        f"`open_loop_bound.py`: the GPU prefilling one request at a time at this run's fitted cost "
        f"({srv.b:.3g}*n*(p+n/2) + {srv.a:.3g}*n s, +{srv.c0:.3f} s latency), the disk at its raw read rate "
        f"({srv.read_Bps / 1e9:.2f} GB/s), no forecast error, GPU memory unlimited (a yardstick, not a strict "
        "bound: the model's recompute is ideal too). Per request: each request loaded or computed, whichever "
        "finishes it first; joined: besides those, the split SGLang 0.5.17 can join (`policy_split`: a head of whole "
        f"chunks of {srv.chunk}, the tail counted in gets of {srv.grain} tokens by the time the head's last chunk starts); "
        "split: the GPU computes any head while the disk loads the rest (beyond what SGLang can join).", ""]

    def x(a: float, b: float) -> str:
        return _f(_ratio(a, b), "x", 2)

    if s["burst"]:
        n = int((doc.get("args") or {}).get("burst") or len(lengths))
        b = olb.burst(srv, lengths[:n])
        rc, ours = s["burst"].get("recompute", {}), s["burst"].get(OURS, {})
        lines += ["| burst of %d, against recompute | makespan | mean TTFT |" % n, "|---|---|---|",
                  f"| measured: {OURS} | {x(ours.get('makespan', math.nan), rc.get('makespan', math.nan))} | "
                  f"{x(ours.get('mean_ttft', math.nan), rc.get('mean_ttft', math.nan))} |",
                  f"| ideal: per request | {x(b['per_request'][0], b['recompute'][0])} | "
                  f"{x(b['per_request'][1], b['recompute'][1])} |",
                  f"| ideal: joined | {x(b['joined'][0], b['recompute'][0])} | {x(b['joined'][1], b['recompute'][1])} |",
                  f"| ideal: split | {x(b['split'][0], b['recompute'][0])} | {x(b['split'][1], b['recompute'][1])} |", ""]
    if not s["open"]:
        return lines
    k = olb.knee(srv, lengths)
    lines += [f"Open loop: on a long Poisson stream recompute's p90 doubles from its idle {k['idle_p90']:.2f} s at "
              f"**{k['rate']:.2f} req/s**; there, per request reaches **{k['per_request_ratio']:.2f}x** recompute's p90, "
              f"joined {k['joined_ratio']:.2f}x, split {k['split_ratio']:.2f}x (the target: 0.6x).", "",
              "| rate (req/s) | measured: ours / recompute p90 | ideal on the same arrivals: per request | joined | split |",
              "|---|---|---|---|---|"]
    ours = s["open"].get(OURS, {})
    for rate, ps in sorted(olb.replay(doc, srv, skip=set(s["open_unpaired"])).items()):
        rc = s["open"].get("recompute", {}).get(rate, {}).get("p90", math.nan)
        mine = ours.get(rate, {}).get("p90", math.nan)
        lines.append(f"| {rate:g} | {x(mine, rc)} | {x(ps['per_request'], ps['recompute'])} | "
                     f"{x(ps['joined'], ps['recompute'])} | {x(ps['split'], ps['recompute'])} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--bound", action="store_true", help="add the burst and the open loop against the run's ideal "
                   "server (open_loop_bound.py; seconds of simulation)")
    a = p.parse_args(argv)
    doc = json.load(open(a.results))
    shape = os.path.basename(a.results)[len("suite-"):-len(".json")]
    out = os.path.dirname(os.path.abspath(a.results))
    write_report(doc, out, shape, plot=a.plot, bound=a.bound)
    print(open(os.path.join(out, f"suite-{shape}.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
