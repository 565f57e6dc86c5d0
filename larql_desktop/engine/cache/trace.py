"""Which cache key followed which: the walk's guess of a whole decode step's hits before the step runs.

A decode step looks its layers up one after another, each key known only once the layer before has run: with
every layer a hit, that is still one onnxruntime call per layer plus the head, and those calls alone cost as
much as the whole-model dense graph (SmolLM2: 30 layer calls 7.8-8.0 ms a token, the head 1.5 ms, the dense
decoder 9.5-10 ms). When a sequence repeats (a regenerate, the same prompt again, a client re-sending a
conversation), so does its chain of keys. `KeyTrace` remembers, for each key a layer looked up, the key the next
layer looked up after it, and for each step's first layer the key that followed the previous step's last key and
this step's token. From the step's token the walk can then name every layer's entry in advance and run the
whole step in one call of the served decoder graph (graphs/decoder.py), then check each guess against what the
graph computed: a guess is only ever a guess, and an entry is served only where the key and the hit rule hold,
exactly as a lookup would (cache/walk.py).

One trace per engine, shared by its sessions and API requests like L2: links hold only keys, so a client can
make guesses wrong (slower for whoever follows the same chain), never an answer. Bounded: the least recently
followed links go first.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

DEFAULT_CAPACITY = 1 << 18      # links (~30 layers x 8,700 steps); a link is ~200 bytes


class KeyTrace:
    """A bounded map from a lookup (its layer and key, or a step's start) to the lookup that came next."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"a key trace holds at least one link, not {capacity}")
        self.capacity = capacity
        self._next: OrderedDict[Hashable, Hashable] = OrderedDict()
        self._lock = threading.Lock()

    def link(self, previous: Hashable, following) -> None:
        """`following` (a key, with what the walk wants to know of it) was looked up right after `previous`."""
        with self._lock:
            self._link(previous, following)

    def link_many(self, links) -> None:
        """`link(previous, following)` for each pair of `links`, under one lock."""
        with self._lock:
            for previous, following in links:
                self._link(previous, following)

    def _link(self, previous: Hashable, following) -> None:
        links = self._next
        links[previous] = following
        links.move_to_end(previous)
        if len(links) > self.capacity:
            links.popitem(last=False)

    def follow_chain(self, start: Hashable, length: int, step: Callable[[int, object], Hashable]) -> list | None:
        """`length` lookups followed from `start`, the i-th's successor found under `step(i, it)`; None as soon
        as one has none (one lock for the chain)."""
        chain = []
        previous = start
        with self._lock:
            for i in range(length):
                following = self._next.get(previous)
                if following is None:
                    return None
                chain.append(following)
                previous = step(i, following)
        return chain

    def clear(self) -> None:
        with self._lock:
            self._next.clear()

    def __len__(self) -> int:
        return len(self._next)
