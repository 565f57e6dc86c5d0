"""A KV prefix cache shared by every session of an engine (the OpenAI API's requests and the app's chats): the keys and
values of prompts already prefilled, so a request that starts with the same tokens (a client re-sending its whole
conversation each turn, clients sharing a system prompt) prefills only what follows the longest common prefix, as
llama.cpp's server (`cache_prompt`) and vLLM's automatic prefix caching do.

What makes a reuse exact (a hit is bit-identical to recomputing the prefix):
  * Entries are namespaced by everything the KV of a prompt depends on besides its tokens: the caller passes it
    (LarqlEngine.kv_namespace: the model's checksum, the FFN graphs' numerics, the FFN settings, the INSERT patches'
    epoch, which cache tiers are on, the prefill schedule). A patch applied or a setting changed makes a new
    namespace, so a stale prefix is never found; its entries age out by LRU (a patch removed again brings them
    back into use, still valid).
  * A prompt is prefilled in chunks cut at the same places (`PrefillSchedule`: multiples of the chunk size, and the
    end of the chat template's fixed head in a prompt that starts with it), with or without a hit, and only whole
    chunks are stored and reused. onnxruntime's kernels do not give a row the same result whatever pass it is in
    (measured: a row of a 129-position pass differs from the same row in a 128-position one, Gemma's attention rows
    differ below and above 64 positions, a one-position decode step differs from a prefill row), but the same pass
    over the same inputs gives the same result: so a hit reuses exactly the chunks a cold prefill would compute, and
    computes the rest as a cold prefill would. A reply's own tokens (decode steps) are never stored: the next turn
    prefills them once, in chunks.

Reuse is at chunk granularity (a new conversation reuses the template's head): the entry with the longest common
prefix with the prompt, cut to whole chunks and leaving at least one position to run. Entries are whole chunks of
prompts' KV rows (no block sharing: prompts sharing a system prompt each hold their own copy); storing a prompt that
extends an entry replaces that entry, so a conversation holds one entry, not one per turn. Bounded by bytes, least
recently used first out; an entry larger than the whole budget is not stored.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Hashable, Sequence

import numpy as np

from larql_desktop.engine.model.transformer import KvCache

DEFAULT_PREFIX_CACHE_BYTES = 256 * 2 ** 20    # SmolLM2: 46 KB a token, ~5,700 tokens; Gemma 3 270M: 37 KB a token


@dataclass(frozen=True)
class PrefixCacheStats:
    entries: int
    bytes: int
    max_bytes: int
    lookups: int            # prefills that asked
    hits: int               # of those, the ones that reused at least one position
    misses: int
    reused_tokens: int      # prompt positions not prefilled thanks to a hit
    stored: int             # entries stored (an extended conversation replaces its previous entry)
    evictions: int          # entries dropped for room

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrefixHit:
    length: int                           # positions reused
    keys: tuple[np.ndarray, ...]          # per layer (kv_heads, >= length, head_dim), read-only
    values: tuple[np.ndarray, ...]

    def copy_into(self, kv: KvCache) -> None:
        """Make `kv` hold exactly these `length` positions."""
        kv.truncate(0)
        kv.reserve(self.length)
        for store, rows in ((kv.keys, self.keys), (kv.values, self.values)):
            for layer, src in enumerate(rows):
                store[layer][:, :self.length] = src[:, :self.length]
        kv.length = self.length


@dataclass(frozen=True)
class _Entry:
    ids: np.ndarray                       # int64 (L,)
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """Thread-safe: sessions on several threads look up and store at once; stored arrays are never written."""

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"the prefix cache's size must be 0 (off) or more bytes, not {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Hashable, tuple[int, ...]], _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._lookups = self._hits = self._reused = self._stored = self._evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def longest(self, namespace: Hashable, ids: Sequence[int], schedule: PrefillSchedule) -> PrefixHit | None:
        """The longest stored prefix of `ids` under `namespace` in whole chunks of the prefill `schedule`, leaving
        at least one position to run (None: nothing to reuse). Counts a lookup, and a hit when something is
        reused."""
        if not self.enabled:
            return None
        want = np.asarray(ids, dtype=np.int64)
        limit = want.size - 1
        best, best_key, best_len = None, None, 0
        cuts = schedule.cuts(ids)
        with self._lock:
            self._lookups += 1
            for key, entry in self._entries.items():
                if key[0] != namespace:
                    continue
                n = schedule.floor(min(common_prefix(entry.ids, want), limit), ids, cuts)
                if n > best_len:
                    best, best_key, best_len = entry, key, n
            if best is None or best_key is None:
                return None
            self._entries.move_to_end(best_key)
            self._hits += 1
            self._reused += best_len
        return PrefixHit(best_len, best.keys, best.values)

    def store(self, namespace: Hashable, ids: Sequence[int], kv: KvCache) -> bool:
        """Keep the KV of `ids` (whole aligned chunks: the first len(ids) positions of `kv`, computed by the
        chunked prefill of exactly these tokens under `namespace`). Returns whether it was stored."""
        if not self.enabled or not len(ids) or kv.length < len(ids):
            return False
        n = len(ids)
        want = np.asarray(ids, dtype=np.int64)
        cfg = kv.config
        nbytes = 2 * cfg.n_layers * cfg.n_kv_heads * n * cfg.head_dim * 4
        if nbytes > self.max_bytes:
            return False
        with self._lock:
            for key, entry in self._entries.items():
                if key[0] == namespace and entry.ids.size >= n and common_prefix(entry.ids, want) == n:
                    self._entries.move_to_end(key)      # an entry holds this prompt already (or extends it)
                    return False
        keys = tuple(_frozen(k[:, :n]) for k in kv.keys)      # copies made outside the lock (they take ms)
        values = tuple(_frozen(v[:, :n]) for v in kv.values)
        entry = _Entry(_frozen(want), keys, values, nbytes)
        with self._lock:
            # A stored prompt this one extends is superseded: every lookup it would serve, this one serves as far.
            for key in [k for k, e in self._entries.items()
                        if k[0] == namespace and e.ids.size < n and common_prefix(e.ids, want) == e.ids.size]:
                self._bytes -= self._entries.pop(key).nbytes
            key = (namespace, tuple(want.tolist()))
            if key in self._entries:
                return False
            while self._entries and self._bytes + nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                self._evictions += 1
            self._entries[key] = entry
            self._bytes += nbytes
            self._stored += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(len(self._entries), self._bytes, self.max_bytes, self._lookups, self._hits,
                                    self._lookups - self._hits, self._reused, self._stored, self._evictions)


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, copy=True)
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class PrefillSchedule:
    """Where a prefill cuts a prompt into passes: at the multiples of `size`; in a prompt that starts with `head`
    (the chat template's fixed head: the tokens every conversation on the model's default system prompt starts
    with, SmolLM2's 24), at the head's end, so the head is a whole chunk of its own, reused by every new
    conversation from the prefix cache rather than prefilled again; and after every `cue` (the tokens a chat
    prompt ends with: the user's turn closed and the assistant's opened), so a prompt is whole chunks up to its
    end, and the next turn of its conversation, which re-sends it followed by the reply and a new question,
    reuses all of it rather than all but the tail past its last multiple of `size`. A cue at the prompt's end
    costs no pass; each earlier one (a conversation sent whole for the first time) costs one.
    Other prompts (a system prompt of the user's, plain completions) are not cut at the head: for them the cut
    would be one more pass for nothing. The cuts depend only on the prompt's own tokens, so the passes a prefill
    runs are the same whether it starts at 0 or at a cut a prefix hit supplied."""
    size: int
    head: tuple[int, ...] = ()
    cue: tuple[int, ...] = ()

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"a prefill chunk must hold at least one position, not {self.size}")

    @classmethod
    def for_template(cls, size: int, head: Sequence[int], cue: Sequence[int] = ()) -> "PrefillSchedule":
        """The schedule of a model whose chat template starts every prompt with `head` and ends it with `cue`:
        cut at the head only when it is worth a pass of its own (a quarter of a chunk or more; a template's bare
        turn opening, 3 or 4 tokens, would cost every cold prompt a pass to save a few positions)."""
        return cls(size, tuple(head) if len(head) >= size / 4 else (), tuple(cue))

    def cuts(self, ids: Sequence[int]) -> list[int]:
        """The prompt's own cuts (besides the multiples of `size`), ascending: the head's end, each cue's end."""
        n = len(self.head)
        cuts = [n] if n and len(ids) >= n and tuple(ids[:n]) == self.head else []
        m = len(self.cue)
        if m and len(ids) >= m:
            tokens = np.asarray(ids)
            for i in np.flatnonzero(tokens[:len(tokens) - m + 1] == self.cue[0]):
                if tuple(tokens[i:i + m].tolist()) == self.cue and (not cuts or i + m > cuts[-1]):
                    cuts.append(int(i) + m)
        return cuts

    def floor(self, n: int, ids: Sequence[int], cuts: Sequence[int] | None = None) -> int:
        """The last cut at or before position n of the prompt `ids` (0 when there is none); `cuts`: its own
        cuts, when the caller has them already (`cuts(ids)`: one scan of the prompt for many floors)."""
        whole = n - n % self.size
        return max([whole] + [cut for cut in (self.cuts(ids) if cuts is None else cuts) if cut <= n])

    def chunks(self, start: int, end: int, ids: Sequence[int]):
        """(from, to) position ranges covering start..end of the prompt `ids`, cut at its cuts."""
        cuts = self.cuts(ids)
        pos = start
        while pos < end:
            stop = (pos // self.size + 1) * self.size
            stop = min([stop, end] + [cut for cut in cuts if pos < cut < stop])
            yield pos, stop
            pos = stop
