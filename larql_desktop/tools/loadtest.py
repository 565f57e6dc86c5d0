"""A bounded load test of the local HTTP API: N concurrent clients for a fixed time, loopback only.

Each client posts single-position /v1/walk-ffn requests drawn from a pool of residuals (a small pool gives
hits, a large one misses) and, if asked, some multi-position ones (prefill: bypass). The result counts every
request by the outcome the server reported, so the server's own statistics can be checked against it.

    python -m larql_desktop.tools.loadtest URL --clients 8 --seconds 10 [--token T]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

from larql_desktop.engine.services import is_loopback


@dataclass
class LoadResult:
    seconds: float
    requests: int = 0
    errors: int = 0
    outcomes: dict = field(default_factory=dict)       # cache outcome -> count
    tiers: dict = field(default_factory=dict)          # tier that hit -> count
    latencies: list = field(default_factory=list)      # seconds, every successful request

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        return 1e3 * float(np.percentile(self.latencies, q)) if self.latencies else float("nan")

    def summary(self) -> dict:
        return {"seconds": round(self.seconds, 3), "requests": self.requests, "errors": self.errors,
                "throughput_rps": round(self.throughput, 1), "outcomes": self.outcomes, "tiers": self.tiers,
                "p50_ms": round(self.percentile_ms(50), 2), "p95_ms": round(self.percentile_ms(95), 2),
                "p99_ms": round(self.percentile_ms(99), 2)}


def run_load(url: str, hidden: int, n_layers: int, *, clients: int = 4, seconds: float = 3.0, pool: int = 32,
             prefill_every: int = 0, token: str | None = None, seed: int = 0, top_k: int | None = None) -> LoadResult:
    """Drive the server for `seconds`; every client stops sending when the time is up (in-flight ones finish)."""
    import httpx

    if not is_loopback(urlsplit(url).hostname or ""):
        raise ValueError(f"the load test only targets loopback servers, not {url}")
    if not 1 <= clients <= 64 or not 0 < seconds <= 600:
        raise ValueError("clients must be 1..64 and seconds 0..600")
    rng = np.random.default_rng(seed)
    residuals = [rng.standard_normal(hidden).astype(np.float32) for _ in range(pool)]
    bodies = [json.dumps({"layer": int(i % n_layers), "residual": r.tolist(), "top_k": top_k,
                          "full_output": True}).encode() for i, r in enumerate(residuals)]
    prefill = json.dumps({"layer": 0, "residual": [r.tolist() for r in residuals[:3]], "top_k": top_k}).encode()
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    result = LoadResult(seconds)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        local_rng = np.random.default_rng(seed * 1000 + index)
        outcomes, tiers, latencies, n, errors = {}, {}, [], 0, 0
        with httpx.Client(base_url=url, headers=headers, timeout=30.0) as http:
            while time.monotonic() < deadline:
                n_sent = n + errors
                body = prefill if prefill_every and n_sent % prefill_every == prefill_every - 1 else \
                    bodies[int(local_rng.integers(len(bodies)))]
                t0 = time.perf_counter()
                try:
                    r = http.post("/v1/walk-ffn", content=body)
                except httpx.HTTPError:
                    errors += 1
                    continue
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    errors += 1
                    continue
                doc = r.json()
                n += 1
                latencies.append(dt)
                outcomes[doc["cache"]] = outcomes.get(doc["cache"], 0) + 1
                if doc.get("tier"):
                    tiers[doc["tier"]] = tiers.get(doc["tier"], 0) + 1
        with lock:
            result.requests += n
            result.errors += errors
            result.latencies.extend(latencies)
            for d, src in ((result.outcomes, outcomes), (result.tiers, tiers)):
                for k, v in src.items():
                    d[k] = d.get(k, 0) + v

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    import httpx

    p = argparse.ArgumentParser(prog="python -m larql_desktop.tools.loadtest", description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--pool", type=int, default=32, help="distinct residuals (fewer: more hits)")
    p.add_argument("--prefill-every", type=int, default=0, help="every Nth request is a 3-position prefill")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--token", default=None)
    args = p.parse_args(argv)
    headers = {"authorization": f"Bearer {args.token}"} if args.token else {}
    info = httpx.get(f"{args.url}/v1/model", headers=headers).json()
    res = run_load(args.url, info["hidden"], info["n_layers"], clients=args.clients, seconds=args.seconds,
                   pool=args.pool, prefill_every=args.prefill_every, token=args.token, top_k=args.top_k)
    json.dump(res.summary(), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
