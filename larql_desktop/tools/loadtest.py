"""A bounded load test of the local HTTP API: N concurrent clients for a fixed time, loopback only.

Two modes:
  walk  each client posts single-position /v1/walk-ffn requests drawn from a pool of residuals (a small pool gives
        hits, a large one misses) and, if asked, some multi-position ones (prefill: bypass); every request is
        counted by the outcome the server reported, so the server's own statistics can be checked against it.
  chat  each client streams /v1/chat/completions replies to prompts drawn from a small list (greedy by default, so
        a prompt another client already asked is served from L2), measuring time to first token and tokens per
        second, and adds up each reply's `larql_cache` counts, which must equal the change of the server's
        statistics over the run (nothing else may use the server meanwhile).

  serve like a real inference server's clients (tools/serve_load.py): multi-turn TTFT by turn, shared-system-prompt
        TTFT, aggregate tok/s at 1/2/4/8 clients, a small request beside a long prefill, prefill time by length;
        `--compare URL` runs the same against another OpenAI server (llama-cpp-python's) and reports both.
        Against a base model (`serve --model gemma3-270m`) conversations are sent as plain-text completions, to
        both servers.

    python -m larql_desktop.tools.loadtest URL [--mode walk|chat] --clients 8 --seconds 10 [--token T]
    python -m larql_desktop.tools.loadtest URL --mode serve [--compare http://127.0.0.1:8000] [--turns 8]
        [--client-counts 1,2,4,8] [--sizes 256,1024,2048] [--long-tokens 2048] [--parts multi_turn,...]

Only the standard library's HTTP client is used, so the tool runs wherever the app is installed.
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

from larql_desktop.engine.services import is_loopback

CHAT_PROMPTS = (
    "What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
    "Explain what a cache is in one sentence.", "What is 12 times 12?", "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?", "List the days of the week.", "What does a bee make?",
    "Say hello in Spanish.", "What is the boiling point of water?", "Describe a cat in five words.",
)


def checked_target(url: str, clients: int, seconds: float) -> tuple[str, int]:
    """(host, port) of a load test's target, refused (ValueError) unless loopback and within the limits."""
    parts = urlsplit(url)
    if not is_loopback(parts.hostname or ""):
        raise ValueError(f"the load test only targets loopback servers, not {url}")
    if not 1 <= clients <= 64 or not 0 < seconds <= 600:
        raise ValueError("clients must be 1..64 and seconds 0..600")
    return parts.hostname, parts.port or 80


def auth_headers(token: str | None) -> dict:
    """The request headers of a JSON request, with the bearer token when the server wants one."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def get_json(url: str, path: str, token: str | None = None, timeout: float = 30.0) -> dict:
    host, port = checked_target(url, 1, 1)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=auth_headers(token))
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {r.status}: {body[:200]!r}")
        return json.loads(body)
    finally:
        conn.close()


def _percentile_ms(values: list, q: float) -> float:
    return 1e3 * float(np.percentile(values, q)) if values else float("nan")


# ----------------------------------------------------------------------------------------------- walk mode
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
        return _percentile_ms(self.latencies, q)

    def summary(self) -> dict:
        return {"seconds": round(self.seconds, 3), "requests": self.requests, "errors": self.errors,
                "throughput_rps": round(self.throughput, 1), "outcomes": self.outcomes, "tiers": self.tiers,
                "p50_ms": round(self.percentile_ms(50), 2), "p95_ms": round(self.percentile_ms(95), 2),
                "p99_ms": round(self.percentile_ms(99), 2)}


def run_load(url: str, hidden: int, n_layers: int, *, clients: int = 4, seconds: float = 3.0, pool: int = 32,
             prefill_every: int = 0, token: str | None = None, seed: int = 0, top_k: int | None = None) -> LoadResult:
    """Drive the server for `seconds`; every client stops sending when the time is up (in-flight ones finish)."""
    host, port = checked_target(url, clients, seconds)
    rng = np.random.default_rng(seed)
    residuals = [rng.standard_normal(hidden).astype(np.float32) for _ in range(pool)]
    bodies = [json.dumps({"layer": int(i % n_layers), "residual": r.tolist(), "top_k": top_k,
                          "full_output": True}).encode() for i, r in enumerate(residuals)]
    prefill = json.dumps({"layer": 0, "residual": [r.tolist() for r in residuals[:3]], "top_k": top_k}).encode()
    headers = auth_headers(token)
    result = LoadResult(seconds)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        local_rng = np.random.default_rng(seed * 1000 + index)
        outcomes, tiers, latencies, n, errors = {}, {}, [], 0, 0
        conn = http.client.HTTPConnection(host, port, timeout=30.0)
        try:
            while time.monotonic() < deadline:
                n_sent = n + errors
                body = prefill if prefill_every and n_sent % prefill_every == prefill_every - 1 else \
                    bodies[int(local_rng.integers(len(bodies)))]
                t0 = time.perf_counter()
                try:
                    conn.request("POST", "/v1/walk-ffn", body=body, headers=headers)
                    r = conn.getresponse()
                    data = r.read()
                except (OSError, http.client.HTTPException):
                    errors += 1
                    conn.close()
                    conn = http.client.HTTPConnection(host, port, timeout=30.0)
                    continue
                dt = time.perf_counter() - t0
                if r.status != 200:
                    errors += 1
                    continue
                doc = json.loads(data)
                n += 1
                latencies.append(dt)
                outcomes[doc["cache"]] = outcomes.get(doc["cache"], 0) + 1
                if doc.get("tier"):
                    tiers[doc["tier"]] = tiers.get(doc["tier"], 0) + 1
        finally:
            conn.close()
        with lock:
            result.requests += n
            result.errors += errors
            result.latencies.extend(latencies)
            for d, src in ((result.outcomes, outcomes), (result.tiers, tiers)):
                for k, v in src.items():
                    d[k] = d.get(k, 0) + v

    _run_clients(client, clients)
    result.seconds = time.monotonic() - (deadline - seconds)
    return result


def _run_clients(target, clients: int) -> None:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ----------------------------------------------------------------------------------------------- chat mode
def stats_counts(doc: dict) -> dict:
    """The counts of a /v1/cache-stats document in the shape of a reply's `larql_cache` (totals only)."""
    tiers = doc["tiers"]
    return {"ffn_calls": doc["calls"], "lookups": doc["lookups"],
            "hits": {name: t["hits"] for name, t in tiers.items()},
            "tier_misses": {name: t["misses"] for name, t in tiers.items()},
            "misses": doc.get("full_misses", {}).get("total", 0),
            "bypasses": {reason: b["total"] for reason, b in doc["bypasses"].items() if b["total"]},
            "dense_calls": doc["latency_us"]["dense"]["count"]}


def _add_counts(total: dict, part: dict) -> None:
    for key, value in part.items():
        if isinstance(value, dict):
            into = total.setdefault(key, {})
            for k, v in value.items():
                into[k] = into.get(k, 0) + v
        else:
            total[key] = total.get(key, 0) + value


def _difference(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            diff = {k: v - before.get(key, {}).get(k, 0) for k, v in value.items()}
            out[key] = {k: v for k, v in diff.items() if v or key != "bypasses"}
        else:
            out[key] = value - before.get(key, 0)
    return out


def _normalised(counts: dict) -> dict:
    """Zero counts left out, so sums and differences compare whatever tiers or reasons each lists."""
    return {k: ({kk: vv for kk, vv in v.items() if vv} if isinstance(v, dict) else v) for k, v in counts.items()}


@dataclass
class ChatLoadResult:
    seconds: float
    requests: int = 0            # replies that ended with a finish reason and [DONE]
    errors: int = 0              # anything else: an HTTP error, a broken stream, a reply without its counts
    tokens: int = 0              # completion tokens, as `usage` counts them
    ttft: list = field(default_factory=list)         # seconds from sending to the first text chunk
    durations: list = field(default_factory=list)    # seconds per reply
    per_client: list = field(default_factory=list)   # replies each client completed
    reply_counts: dict = field(default_factory=dict)  # the replies' larql_cache counts, added up
    server_counts: dict = field(default_factory=dict)  # the change of /v1/cache-stats over the run

    @property
    def counts_match(self) -> bool:
        return _normalised(self.reply_counts) == _normalised(self.server_counts)

    def summary(self) -> dict:
        return {"seconds": round(self.seconds, 2), "requests": self.requests, "errors": self.errors,
                "requests_per_client": self.per_client, "completion_tokens": self.tokens,
                "tokens_per_second": round(self.tokens / self.seconds, 1) if self.seconds else 0.0,
                "ttft_p50_ms": round(_percentile_ms(self.ttft, 50), 1),
                "ttft_p90_ms": round(_percentile_ms(self.ttft, 90), 1),
                "ttft_p99_ms": round(_percentile_ms(self.ttft, 99), 1),
                "reply_p50_s": round(_percentile_ms(self.durations, 50) / 1e3, 2),
                "counts_match": self.counts_match, "reply_counts": _normalised(self.reply_counts),
                "server_counts": _normalised(self.server_counts)}


def _stream_chat(conn: http.client.HTTPConnection, body: bytes, headers: dict) -> tuple[float | None, dict]:
    """One streamed reply: (seconds to the first text chunk, the finish chunk) or an exception."""
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    first, final, done = None, None, False
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            done = True
            continue
        doc = json.loads(data)
        if "error" in doc:
            raise RuntimeError(doc["error"]["message"])
        for choice in doc.get("choices", ()):
            if choice["delta"].get("content") and first is None:
                first = time.perf_counter() - t0
            if choice.get("finish_reason"):
                final = doc
    if not done or final is None or "larql_cache" not in final:
        raise RuntimeError("the stream ended without its finish chunk, cache counts or [DONE]")
    return first, final


def run_chat_load(url: str, model: str, *, clients: int = 8, seconds: float = 30.0, max_tokens: int = 48,
                  temperature: float = 0.0, prompts: tuple[str, ...] = CHAT_PROMPTS, token: str | None = None,
                  seed: int = 0) -> ChatLoadResult:
    """`clients` threads stream chat replies back to back for `seconds` (replies in flight then finish)."""
    host, port = checked_target(url, clients, seconds)
    headers = auth_headers(token)
    result = ChatLoadResult(seconds, per_client=[0] * clients)
    lock = threading.Lock()
    before = stats_counts(get_json(url, "/v1/cache-stats", token))
    started = time.monotonic()
    deadline = started + seconds

    def client(index: int) -> None:
        rng = np.random.default_rng(seed * 1000 + index)
        conn = http.client.HTTPConnection(host, port, timeout=120.0)
        counts, ttft, durations, tokens, done, errors = {}, [], [], 0, 0, 0
        try:
            while time.monotonic() < deadline:
                prompt = prompts[int(rng.integers(len(prompts)))]
                body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                                   "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                                   "seed": int(rng.integers(2 ** 31))}).encode()
                t0 = time.perf_counter()
                try:
                    first, final = _stream_chat(conn, body, headers)
                except (OSError, http.client.HTTPException, RuntimeError, ValueError):
                    errors += 1
                    conn.close()
                    conn = http.client.HTTPConnection(host, port, timeout=120.0)
                    continue
                durations.append(time.perf_counter() - t0)
                if first is not None:
                    ttft.append(first)
                tokens += final["usage"]["completion_tokens"]
                _add_counts(counts, final["larql_cache"])
                done += 1
        finally:
            conn.close()
        with lock:
            result.requests += done
            result.errors += errors
            result.tokens += tokens
            result.ttft.extend(ttft)
            result.durations.extend(durations)
            result.per_client[index] = done
            _add_counts(result.reply_counts, counts)

    _run_clients(client, clients)
    result.seconds = time.monotonic() - started
    result.server_counts = _difference(stats_counts(get_json(url, "/v1/cache-stats", token)), before)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m larql_desktop.tools.loadtest", description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("--mode", choices=("walk", "chat", "serve"), default="walk")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--pool", type=int, default=32, help="walk: distinct residuals (fewer: more hits)")
    p.add_argument("--prefill-every", type=int, default=0, help="walk: every Nth request is a 3-position prefill")
    p.add_argument("--top-k", type=int, default=None, help="walk: K of each request")
    p.add_argument("--max-tokens", type=int, default=48, help="chat: tokens per reply")
    p.add_argument("--temperature", type=float, default=0.0, help="chat: 0 (greedy) repeats replies exactly")
    p.add_argument("--token", default=None)
    p.add_argument("--compare", default=None, help="serve: another OpenAI server's URL, measured the same way")
    p.add_argument("--compare-token", default=None)
    p.add_argument("--turns", type=int, default=8, help="serve: turns of the re-sent conversation")
    p.add_argument("--shared-clients", type=int, default=4, help="serve: clients sharing a system prompt")
    p.add_argument("--client-counts", default="1,2,4,8", help="serve: concurrent clients for aggregate tok/s")
    p.add_argument("--replies", type=int, default=2, help="serve: replies per client for aggregate tok/s")
    p.add_argument("--sizes", default="256,1024,2048", help="serve: prompt lengths whose prefill is timed")
    p.add_argument("--long-tokens", type=int, default=2048, help="serve: the long prompt beside a small request")
    p.add_argument("--beside-delay", type=float, default=1.5, help="serve: seconds between the long and small one")
    p.add_argument("--parts", default="multi_turn,shared_prefix,aggregate,beside_long,prefill")
    args = p.parse_args(argv)
    if args.mode == "serve":
        from larql_desktop.tools.serve_load import run_serve_load

        options = dict(turns=args.turns, max_tokens=args.max_tokens, shared_clients=args.shared_clients,
                       client_counts=tuple(int(c) for c in args.client_counts.split(",")), replies=args.replies,
                       long_tokens=args.long_tokens, beside_delay=args.beside_delay,
                       sizes=tuple(int(n) for n in args.sizes.split(",")), parts=tuple(args.parts.split(",")))
        report = {"larql": run_serve_load(args.url, None, token=args.token, **options)}
        if args.compare:     # the same requests: a base model's conversations as plain text there too
            report["compare"] = run_serve_load(args.compare, None, token=args.compare_token,
                                               chat=report["larql"]["conversations"] == "chat", **options)
        json.dump(report, sys.stdout, indent=1)
        print()
        errors = [e for side in report.values() for row in side.get("aggregate", ()) for e in row["errors"]]
        return 0 if not errors else 1
    if args.mode == "chat":
        model = get_json(args.url, "/v1/models", args.token)["data"][0]["id"]
        res = run_chat_load(args.url, model, clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens,
                            temperature=args.temperature, token=args.token)
    else:
        info = get_json(args.url, "/v1/model", args.token)
        res = run_load(args.url, info["hidden"], info["n_layers"], clients=args.clients, seconds=args.seconds,
                       pool=args.pool, prefill_every=args.prefill_every, token=args.token, top_k=args.top_k)
    json.dump(res.summary(), sys.stdout, indent=1)
    print()
    return 0 if res.errors == 0 and getattr(res, "counts_match", True) else 1


if __name__ == "__main__":
    sys.exit(main())
