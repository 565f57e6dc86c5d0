"""`loadtest --mode serve`: what a client of an inference server feels, measured with the OpenAI API alone, so the
same run can point at this server and at another one (llama-cpp-python's `python -m llama_cpp.server`) beside it:

  multi_turn     one conversation whose client re-sends the whole history each turn: time to first token by turn
  shared_prefix  clients one after another, each with the same long system prompt and its own question: TTFT each
  aggregate      N clients streaming greedy replies at once: completion tokens per second of all of them together
                 (from larql-desktop, also its batched decoder calls and rows per call, and its seconds in prefill,
                 in decode steps and idle, from /v1/cache-stats: the decode rate alone is what batching moves)
  beside_long    a short request's TTFT alone, then sent while a long prompt (`--long-tokens`) is being prefilled
  prefill        time of a 1-token completion of prompts of 256 / 1,024 / 2,048 tokens (the prompt's first words
                 differ every run, so no server can serve them from a prefix cache)

Only the standard library's HTTP client; the server must be on loopback. Prompts are text (every server takes text)
sized from the server's own `usage.prompt_tokens` for a calibration prompt. A base model (larql-desktop's card says
`chat: false`, as for Gemma 3 270M) has no chat template: its conversations go to /v1/completions as plain text
("User: ...", "Assistant: ..." paragraphs), and the server beside it is sent the same requests.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

from larql_desktop.tools.loadtest import checked_target, auth_headers

WORDS = ("amber", "basalt", "cobalt", "dolomite", "emerald", "feldspar", "garnet", "hematite", "jasper", "kyanite")
SYSTEM = ("You are the guide of a museum of natural history. The museum has twelve halls: minerals, meteorites, "
          "dinosaurs, early mammals, birds of the coast, the deep sea, insects, the ice age, volcanoes, human origins, "
          "the living river and the garden of seeds. Answer visitors in one or two sentences, name the hall they "
          "should visit, never invent opening hours or prices, and suggest one more hall nearby. ")


class Client:
    def __init__(self, url: str, model: str, token: str | None = None, timeout: float = 600.0, chat: bool = True):
        self.host, self.port = checked_target(url, 1, 1)
        self.model, self.headers, self.timeout = model, auth_headers(token), timeout
        self.uses_chat = chat       # False: conversations are sent as plain-text completions (a base model)

    def stream(self, path: str, body: dict) -> dict:
        """One streamed request: seconds to the first text, total seconds, completion tokens and the reply text."""
        body = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            t0 = time.perf_counter()
            conn.request("POST", path, body=json.dumps(body).encode(), headers=self.headers)
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
            first, pieces, chunks, usage = None, [], 0, None
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    raise RuntimeError(str(doc["error"]))
                usage = doc.get("usage") or usage
                for choice in doc.get("choices") or ():
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        first = first if first is not None else time.perf_counter() - t0
                        pieces.append(text)
                        chunks += 1
            total = time.perf_counter() - t0
        finally:
            conn.close()
        tokens = usage["completion_tokens"] if usage else chunks
        return {"ttft": first if first is not None else total, "seconds": total, "tokens": tokens,
                "prompt_tokens": usage.get("prompt_tokens") if usage else None, "text": "".join(pieces),
                "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}

    def scheduling_stats(self) -> dict | None:
        """This server's scheduling counters (larql-desktop's /v1/cache-stats `scheduling`: prefill chunks stopped
        for a newly arrived shorter prompt, seconds busy by kind of step); None from a server without them."""
        return self._server_stats("scheduling")

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until the server has written its persistent cache's queue (larql-desktop's /v1/cache-stats
        `l3.queued_writes`; at once for a server without it): each measurement then starts on a quiet server, not
        beside the write-behind of the one before (a backlog written while one client decodes alone took a
        fifth of its speed and made the ratios swing)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            l3 = self._server_stats("l3")
            if not l3 or not l3.get("queued_writes"):
                return
            time.sleep(0.2)

    def server_stats(self) -> dict:
        """This server's /v1/cache-stats document, read once ({} from a server without it)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request("GET", "/v1/cache-stats", headers=self.headers)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                return {}
            doc = json.loads(body)
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}
        finally:
            conn.close()

    def _server_stats(self, part: str) -> dict | None:
        return stats_part(self.server_stats(), part)

    def chat(self, messages: list[dict], max_tokens: int) -> dict:
        if not self.uses_chat:
            return self.complete(transcript(messages), max_tokens)
        return self.stream("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                    "temperature": 0})

    def complete(self, prompt: str, max_tokens: int) -> dict:
        return self.stream("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def transcript(messages: list[dict]) -> str:
    """A conversation as a base model's plain-text prompt: a "Role: content" paragraph per message, then the
    assistant's cue (the same text whichever server it is sent to)."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def filler(sentences: int, salt: int) -> str:
    """Text whose first words differ with `salt` (no prefix is shared between runs)."""
    return f"Catalogue {salt}. " + " ".join(f"Drawer {salt}-{i} holds {WORDS[i % len(WORDS)]} from site {i * 7 % 97}."
                                            for i in range(sentences))


def stats_part(doc: dict, part: str) -> dict | None:
    """One part of a /v1/cache-stats document (`batch`, `scheduling`, `l3`), or None where the server has none."""
    found = doc.get(part)
    return found if isinstance(found, dict) else None


def _rounded(x: float) -> float:
    return round(x, 3)


def multi_turn(client: Client, turns: int, max_tokens: int, salt: int) -> list[dict]:
    messages = [{"role": "system", "content": f"Guided tour {salt}. " + SYSTEM}]   # shares no prefix with shared_prefix
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"I am on my visit's step {turn + 1}. Which hall shows "
                                                    f"{WORDS[turn % len(WORDS)]}, and what is next to it?"})
        r = client.chat(messages, max_tokens)
        messages.append({"role": "assistant", "content": r["text"]})
        out.append({"turn": turn + 1, "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"],
                    "ttft_s": _rounded(r["ttft"])})
    return out


def shared_prefix(client: Client, clients: int, max_tokens: int, salt: int) -> list[dict]:
    system = f"Visitor desk {salt}. " + SYSTEM * 3
    return [{"client": i + 1, "ttft_s": _rounded(r["ttft"]), "cached_tokens": r["cached_tokens"],
             "prompt_tokens": r["prompt_tokens"]}
            for i, r in enumerate(client.chat([{"role": "system", "content": system},
                                               {"role": "user", "content": f"Where is the {w} drawer?"}], max_tokens)
                                  for w in WORDS[:clients])]


def aggregate(client: Client, counts: list[int], max_tokens: int, replies: int, salt: int) -> list[dict]:
    """Every client's prompts differ from every other's, in this row and in the others and in earlier runs (the
    salt): a prompt decoded before would be served from the FFN cache tiers, not walked, and flatter the ratio."""
    # One reply before the rows, not counted: the first request after a start (or after another part) pays for
    # what every later one reuses (the chat template's head prefilled into the prefix cache, the batch's first
    # bindings), which would slow the one-client row the ratios divide by.
    client.settle()
    client.chat([{"role": "user", "content": f"Warm-up at desk {salt}: name a colour."}], max_tokens)
    out = []
    for row_index, n in enumerate(counts):
        tokens = [0] * n
        errors: list[str] = []

        def one(index: int) -> None:
            try:
                for r in range(replies):
                    text = (f"Client {index} of {n} reply {r} (desk {salt}, row {row_index}): describe "
                            f"{WORDS[(index + r) % len(WORDS)]} in detail.")
                    tokens[index] += client.chat([{"role": "user", "content": text}], max_tokens)["tokens"]
            except Exception as exc:   # noqa: BLE001 - reported, not hidden
                errors.append(repr(exc))
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        client.settle()
        stats_before = client.server_stats()        # one read for the batch's and the scheduling's counters
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        stats_after = client.server_stats()
        before, after = stats_part(stats_before, "batch"), stats_part(stats_after, "batch")
        busy_before = (stats_part(stats_before, "scheduling") or {}).get("busy_seconds")
        busy_after = (stats_part(stats_after, "scheduling") or {}).get("busy_seconds")
        row = {"clients": n, "tokens": sum(tokens), "seconds": _rounded(seconds),
               "tok_per_s": round(sum(tokens) / seconds, 1), "per_client_tokens": tokens, "errors": errors}
        if before is not None and after is not None:
            # How the server decoded them: batched decoder calls, and the tokens per call (1.0: no batching).
            steps = after["steps"] - before["steps"]
            row["batched_steps"] = steps
            row["rows_per_batched_step"] = round((after["row_steps"] - before["row_steps"]) / steps, 2) if steps \
                else None
            # By kind of call (dense, walked, and the walk's served and replayed steps; a call holding walked and
            # served rows counts for each), the calls that ran alone of their kind in a step, and the mixed calls.
            row["rows_per_batched_step_by_kind"] = _per_kind(before.get("by_kind") or {}, after.get("by_kind") or {})
            row["solo_steps"] = after.get("solo_steps", 0) - before.get("solo_steps", 0)
            row["mixed_steps"] = after.get("mixed_steps", 0) - before.get("mixed_steps", 0)
        if busy_before and busy_after:
            # Where the row's seconds went on the server: prompts' prefill, decode steps (batched or one reply's),
            # and idle (between steps: requests in flight, the event loop). The decode rate alone is what the
            # batch changes; prefill grows with the clients whatever the batch does.
            busy = {kind: _rounded(busy_after[kind] - busy_before.get(kind, 0.0)) for kind in busy_after}
            decode = sum(v for kind, v in busy.items() if kind != "prefill")
            row["server_seconds"] = {**busy, "idle": _rounded(max(0.0, seconds - sum(busy.values())))}
            row["decode_tok_per_s"] = round(sum(tokens) / decode, 1) if decode else None
        out.append(row)
    alone: dict = out[0] if out and out[0]["clients"] == 1 else {}      # the one-client row the ratios divide by
    for row in out:
        row["vs_one_client"] = round(row["tok_per_s"] / alone["tok_per_s"], 2) if alone else None
        if alone.get("decode_tok_per_s") and row.get("decode_tok_per_s"):
            row["decode_vs_one_client"] = round(row["decode_tok_per_s"] / alone["decode_tok_per_s"], 2)
    return out


def _per_kind(before: dict, after: dict) -> dict:
    """{kind: {"steps", "rows_per_step"}} between two snapshots of the batch's by_kind counts."""
    out = {}
    for kind, counts in after.items():
        steps = counts["steps"] - before.get(kind, {}).get("steps", 0)
        rows = counts["row_steps"] - before.get(kind, {}).get("row_steps", 0)
        if steps:
            out[kind] = {"steps": steps, "rows_per_step": round(rows / steps, 2)}
    return out


def sentences_for(client: Client, tokens: int, salt: int) -> int:
    """Filler sentences for about `tokens` prompt tokens, from the server's count for 40 of them (same salt width)."""
    probe = client.complete(filler(40, salt), 1)["prompt_tokens"] or 40 * 12
    return max(1, round(40 * tokens / probe))


def beside_long(client: Client, long_tokens: int, delay: float, salt: int) -> dict:
    small = [{"role": "user", "content": "Hi"}]
    alone = client.chat(small, 4)["ttft"]
    long_prompt = filler(sentences_for(client, long_tokens, salt + 1), salt)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(client.complete(long_prompt, 1)), daemon=True)
    before = client.scheduling_stats()
    worker.start()
    time.sleep(delay)        # a tool, not a test: the small request arrives while the long prefill runs
    beside = client.chat(small, 4)["ttft"]
    worker.join()
    after = client.scheduling_stats()
    return {"small_alone_ttft_s": _rounded(alone), "small_beside_long_ttft_s": _rounded(beside),
            "ratio": round(beside / alone, 2) if alone else None, "long_prompt_tokens": result.get("prompt_tokens"),
            "long_seconds": _rounded(result.get("seconds", float("nan"))),
            # larql-desktop: 1 when the long prompt's chunk stopped between layers for the small request (0: the
            # small one came between two chunks, or the long prefill had ended); None from another server.
            "chunk_stops": after["chunk_stops"] - before["chunk_stops"] if before and after else None}


def prefill(client: Client, sizes: list[int], salt: int) -> list[dict]:
    out = []
    for i, size in enumerate(sizes):
        run_salt = salt * 100 + i + 1
        r = client.complete(filler(sentences_for(client, size, run_salt + 50), run_salt), 1)
        out.append({"target_tokens": size, "prompt_tokens": r["prompt_tokens"], "seconds": _rounded(r["seconds"])})
    return out


def run_serve_load(url: str, model: str | None, *, token: str | None = None, turns: int = 8, max_tokens: int = 32,
                   shared_clients: int = 4, client_counts: tuple[int, ...] = (1, 2, 4, 8), replies: int = 2,
                   long_tokens: int = 2048, beside_delay: float = 1.5, sizes: tuple[int, ...] = (256, 1024, 2048),
                   parts: tuple[str, ...] = ("multi_turn", "shared_prefix", "aggregate", "beside_long", "prefill"),
                   chat: bool | None = None) -> dict:
    """The parts' figures from the server at `url` (its first model unless `model`). `chat`: whether conversations
    use /v1/chat/completions; None: as the server's model card says (larql-desktop's `larql.chat`; yes if the card
    does not say), False: plain-text completions (`transcript`)."""
    card = _first_model(url, token)
    if model is None:
        model = card["id"]
    if chat is None:
        chat = bool((card.get("larql") or {}).get("chat", True))
    client = Client(url, model, token, chat=chat)
    salt = int(time.time() * 1000) % 1_000_000
    report: dict = {"url": url, "model": model, "conversations": "chat" if chat else "completions"}
    # One reply first, unmeasured: the first requests a server takes warm its graphs and sessions, which would
    # slow whichever measurement comes first (the multi-turn conversation's first turn, the 1-client row).
    client.chat([{"role": "user", "content": f"Warm-up (desk {salt}): describe {WORDS[0]}."}], max_tokens)
    if "multi_turn" in parts:
        client.settle()
        report["multi_turn"] = rows = multi_turn(client, turns, max_tokens, salt)
        report["multi_turn_last_vs_first"] = round(rows[-1]["ttft_s"] / rows[0]["ttft_s"], 2) if rows[0]["ttft_s"] \
            else None
    if "shared_prefix" in parts:
        client.settle()
        report["shared_prefix"] = rows = shared_prefix(client, shared_clients, max_tokens, salt)
        later = [r["ttft_s"] for r in rows[1:]]
        report["shared_prefix_later_vs_first"] = round(sum(later) / len(later) / rows[0]["ttft_s"], 2) \
            if later and rows[0]["ttft_s"] else None
    if "aggregate" in parts:
        report["aggregate"] = aggregate(client, list(client_counts), max_tokens, replies, salt)
    if "beside_long" in parts:
        client.settle()
        report["beside_long"] = beside_long(client, long_tokens, beside_delay, salt)
    if "prefill" in parts:
        client.settle()
        report["prefill"] = prefill(client, list(sizes), salt)
    return report


def _first_model(url: str, token: str | None) -> dict:
    """The card of the first model the server lists (`id`, and larql-desktop's `larql` details)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
    try:
        conn.request("GET", "/v1/models", headers=auth_headers(token))
        return json.loads(conn.getresponse().read())["data"][0]
    finally:
        conn.close()
