"""A remote-tier client in its own process: `python remote_client.py JSON` prints a JSON result.

op "put": put `keys` (data from `salt`), starting at wall time `start`; "get": get and check them.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from remote_helpers import Bufs, page_data, tier  # noqa: E402


def main() -> None:
    a = json.loads(sys.argv[1])
    t = tier(a["url"], a["prefix"], a["page"], a["ident"])
    keys = a["keys"]
    b = Bufs(t, len(keys), a["page"])
    out = {}
    time.sleep(max(0.0, a.get("start", 0) - time.time()))
    if a["op"] == "put":
        pages = b.fill(keys, a.get("salt", ""))
        out["ok"] = []
        for i in range(0, len(keys), a.get("batch", 16)):
            out["ok"] += t.put(keys[i:i + a.get("batch", 16)], pages.select(range(i, min(i + a.get("batch", 16), len(keys)))))
    else:
        ok = t.get(keys, b.poisoned(len(keys)))
        out["ok"] = ok
        out["which"] = []
        for i, (k, hit) in enumerate(zip(keys, ok)):
            if not hit:
                out["which"].append(None)
                continue
            got = b.got(i)
            out["which"].append(next((s for s in a.get("salts", [""]) if (got == page_data(k, a["page"], s)).all()),
                                     "CORRUPT"))
    out["stats"] = {k: v for k, v in t.stats().items() if isinstance(v, (int, float, str))}
    t.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
