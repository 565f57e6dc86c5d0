"""Running the model for INSERT: greedy continuations, and captures (per layer the normed FFN input and the
residual after attention, with the KV cache) that are resumed from a changed layer or extended by more tokens
instead of re-run whole; the negatives' captures, under the base weights, and the base model's continuations are
remembered between inserts (and, given a CaptureStore, kept on disk between launches). And the cancel check every
step of an insert makes."""
from __future__ import annotations

import threading
from collections import OrderedDict
from itertools import islice, takewhile
from typing import Callable, NamedTuple, Sequence

import numpy as np
import onnxruntime as ort

from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.graphs.batched import OnnxBatchedDecoder
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.model.generation import greedy
from larql_desktop.engine.model.overlay import PatchOperation, PatchOverlay
from larql_desktop.engine.model.together import Resumed, Run, forward_together, resume_together
from larql_desktop.engine.model.transformer import KvCache, LayerRecord, zeroed_layer_pairs
from larql_desktop.engine.patches.insert.capture_store import CaptureStore, StoredCapture

CONTINUATION_TOKENS = 10
GREEDY_ROWS = 16         # base continuations decoded together in one batched decoder call (greedy_many)
# Base continuations remembered by an Inserter (a few dozen token ids each): an insert under a relation not seen
# before asks for ~40 new ones, so 256 held about six relations' and facts that cycled through ten relations
# (insert-eval --together 50) found none of theirs.
CONTINUATION_MEMORY = 1024
# The negatives' FFN inputs an Inserter remembers, least recently used forgotten first (base_inputs), in half
# precision (REMEMBERED_DTYPE): one insert's negatives are ~50 contexts, ~4,000 tokens, ~86 MB over SmolLM2's key
# layers (since the conversations after six same-relation replies), nearly all of them shared by every insert
# under the same relation. The bound holds about ten relations' worth; at 256 MB of single precision (two
# relations) every insert of facts cycling through ten relations captured its negatives anew.
CAPTURE_MEMORY_BYTES = 896 * 2 ** 20
# Rows precise to ~3 decimal digits (|x| up to ~31 measured on both models, far below half precision's 65,504):
# the Fisher solve sums their single-precision products in double and `free_slots` scores them in single
# precision. The layer a `written_inputs_all` pass resumes from is kept in single precision, with its residual: the
# resumed layers read it as the pass made it.
REMEMBERED_DTYPE = np.float16
PREFETCH_CONTEXTS = 16    # base captures run together by prefetch_inputs (~90 MB of rows in flight at a time)
FIRING_TOLERANCE = 1e-3   # of a gate score: `recapture_all` re-runs from the first position scoring above minus this


class GreedyRequest(NamedTuple):
    """A base continuation `Capturing.prefetch_greedy` runs: where its tokens are remembered and how it runs."""
    memory: dict
    key: object
    ids: tuple[int, ...]
    n: int
    enough: Callable[[list[int]], bool] | None


def remember(memory: dict, key, tokens: list[int]) -> None:
    if key not in memory and len(memory) >= CONTINUATION_MEMORY:
        memory.pop(next(iter(memory)))      # the oldest
    memory[key] = tokens


def common_prefix(before: Sequence[int], ids: Sequence[int]) -> int:
    """How many first tokens `ids` shares with `before`, leaving at least its last to run (for its logits)."""
    shared, limit = 0, min(len(before), len(ids) - 1)
    while shared < limit and before[shared] == ids[shared]:
        shared += 1
    return shared


class Captured(NamedTuple):
    """One context's pass: per layer the normed FFN input (T, d), the last position's logits, the KV cache, and
    per layer the residual after attention (T, d) that `Inserter.recapture_all` resumes from."""
    inputs: list
    logits: np.ndarray
    kv: KvCache
    residuals: Sequence


class RememberedInputs(NamedTuple):
    """A negative context's base FFN inputs as `Capturing.base_inputs` remembers them (REMEMBERED_DTYPE), and for
    the contexts `Capturing.written_inputs_all` resumes, the residual after attention at the layer it resumes from
    (that layer's inputs in single precision too)."""
    from_layer: int
    inputs: list
    nbytes: int
    residual: tuple[int, np.ndarray] | None = None     # (layer, (T, d))


class InsertCancelled(Exception):
    """The insert was cancelled between two of its steps; nothing was installed."""


class Cancel:
    """Anything with is_set() (a threading.Event) or a callable returning True when the insert must stop."""

    def __init__(self, flag):
        self.flag = flag

    def check(self) -> None:
        flag = self.flag
        if flag is None:
            return
        stop = flag.is_set() if isinstance(flag, threading.Event) or hasattr(flag, "is_set") else flag()
        if stop:
            raise InsertCancelled("INSERT cancelled; no patch was installed")


def softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max()
    p = np.exp(z)
    return p / p.sum()


def _covers(known: "RememberedInputs | StoredCapture", from_layer: int, residual_at: int | None) -> bool:
    """Whether a remembered capture holds the layers from `from_layer` on, and the residual a pass resumes from."""
    return known.from_layer <= from_layer and (
        residual_at is None or (known.residual is not None and known.residual[0] == residual_at))


class Capturing:
    """Forward passes under an overlay (the FFN from `ffn`, which the Inserter builds)."""
    model: LoadedModel
    ffn: Callable[[PatchOverlay], WalkFfn]
    walk: WalkSettings
    _remembered: "OrderedDict[tuple[int, ...], RememberedInputs]"
    capture_store: CaptureStore | None      # the negatives' captures kept on disk between launches, if given
    _continued: dict[str, list[int]]
    _deferred: list[GreedyRequest] | None
    _batched: list[OnnxBatchedDecoder | None]     # empty until made (batched_decoder)

    def batched_decoder(self) -> OnnxBatchedDecoder | None:
        """The model's batched decoder graph (exported beside its other graphs on first use), made on first use;
        None for a model without decoder graphs (the numpy reference)."""
        if not self._batched:
            decoder = self.model.transformer.decoder
            self._batched.append(None if decoder is None else OnnxBatchedDecoder(
                self.model.gguf, self.model.config, self.model.checksum, decoder.directory.parent,
                self.model.threads))
        return self._batched[0]

    def encode(self, text: str) -> list[int]:
        return self.model.tokenizer.encode(text)

    def last_logits(self, text: str, overlay: PatchOverlay) -> np.ndarray:
        return self.model.transformer.forward(self.encode(text), KvCache(self.model.config), self.ffn(overlay))[-1]

    def probability(self, text: str, token: int, overlay: PatchOverlay) -> float:
        return float(softmax(self.last_logits(text, overlay))[token])

    def greedy(self, ids: Sequence[int], overlay: PatchOverlay, n: int,
               enough: Callable[[list[int]], bool] | None = None) -> list[int]:
        """Up to n greedy tokens after `ids` under the overlay, stopping before a stop token, and after the
        token with which `enough(tokens so far)` holds (each token is a forward pass: the callers that only
        need a reply's start stop there)."""
        kv = KvCache(self.model.config, capacity=len(ids) + n + 1)
        stops = self.model.tokenizer.stop_ids
        out: list[int] = []
        for token in takewhile(lambda token: token not in stops,
                               islice(greedy(self.model.transformer, ids, self.ffn(overlay), kv), n)):
            out.append(token)
            if enough is not None and enough(out):
                break
        return out

    def remembered_greedy(self, memory: dict, key, ids: Sequence[int], n: int,
                          enough: Callable[[list[int]], bool] | None = None) -> list[int]:
        """The base model's `greedy` continuation of `ids`, remembered in `memory` under `key` (an Inserter keeps
        CONTINUATION_MEMORY of each kind: many are the same for every insert, or every insert under one
        relation). While `prefetch_greedy` lists what is missing, one not yet remembered is listed and [] is
        returned in its place."""
        if key in memory:
            return memory[key]
        stored = self._stored_greedy(memory, key, ids, n)
        if stored is not None:
            remember(memory, key, stored)
            return stored
        if self._deferred is not None:
            self._deferred.append(GreedyRequest(memory, key, tuple(ids), n, enough))
            return []
        tokens = self.greedy(ids, PatchOverlay(), n, enough)
        self._remember_greedy(memory, key, ids, n, tokens)
        return tokens

    def _greedy_kind(self, memory: dict, key, n: int) -> str:
        """A continuation's kind in the capture store: which memory (what stops it), how many tokens, its key."""
        name = next(name for name, value in vars(self).items() if value is memory)
        return f"{name}\0{n}\0{key!r}"

    def _stored_greedy(self, memory: dict, key, ids: Sequence[int], n: int) -> list[int] | None:
        namespace = self.capture_namespace()
        if self.capture_store is None or namespace is None:
            return None
        return self.capture_store.get_tokens(namespace, self._greedy_kind(memory, key, n), ids)

    def _remember_greedy(self, memory: dict, key, ids: Sequence[int], n: int, tokens: list[int]) -> None:
        remember(memory, key, tokens)
        namespace = self.capture_namespace()
        if self.capture_store is not None and namespace is not None:
            self.capture_store.put_tokens(namespace, self._greedy_kind(memory, key, n), ids, tokens)

    def prefetch_greedy(self, build: Callable[[], object], stop: "Cancel", rounds: int = 3) -> None:
        """Run the base continuations `build` asks `remembered_greedy` for, together (greedy_many), before it runs
        for real: `build` first runs with every missing one listed and answered [], then those run, up to
        `rounds` times (a continuation may be asked of a context made of another's answer)."""
        for _ in range(rounds):
            self._deferred = []
            try:
                build()
                pending = list({(id(r.memory), r.key): r for r in self._deferred}.values())
            finally:
                self._deferred = None
            if not pending:
                return
            for request, tokens in zip(pending, self.greedy_many(pending, stop)):
                self._remember_greedy(request.memory, request.key, request.ids, request.n, tokens)

    def greedy_many(self, requests: Sequence["GreedyRequest"], stop: "Cancel") -> list[list[int]]:
        """`greedy` under the base weights of each request, the decode steps of up to GREEDY_ROWS of them in one
        call of the batched decoder graph (each prompt runs alone first, in one call of the decoder graph): a
        few dozen short continuations cost little more than the longest one. One at a time where no batched
        decoder runs (the numpy reference, or a walk whose decode steps go layer by layer)."""
        walk_k = self._walked_step_k()
        batched = self.batched_decoder() if self.walk.dense or walk_k is not None else None
        if batched is None:
            out = []
            for r in requests:
                stop.check()
                out.append(self.greedy(r.ids, PatchOverlay(), r.n, r.enough))
            return out
        # In sorted order, so the rows of a call share prefixes (each prompt runs past the one before's).
        order = sorted(range(len(requests)), key=lambda i: requests[i].ids)
        results: list[list[int]] = [[] for _ in requests]
        for i in range(0, len(order), GREEDY_ROWS):
            stop.check()
            chunk = order[i:i + GREEDY_ROWS]
            for k, tokens in zip(chunk, self._greedy_rows(batched, [requests[k] for k in chunk], walk_k)):
                results[k] = tokens
        return results

    def _walked_step_k(self) -> int | None:
        """K when the base model's decode steps under the walk run whole in the walked decoder graph (no cache
        tier, nothing a step must do layer by layer): the batched walked decoder then computes each row as that
        graph computes it alone (tests/test_batched_walk_graphs.py). None otherwise."""
        ffn = self.ffn(PatchOverlay())
        if self.walk.dense or ffn.lookup_tiers():
            return None
        return ffn.stepper.walk_step_k()

    def _greedy_rows(self, batched, requests: Sequence["GreedyRequest"], walk_k: int | None) -> list[list[int]]:
        """The rows' continuations (`requests` in the sorted order of their prompts): decode steps in the batched
        dense decoder, or with `walk_k` in the batched walked decoder."""
        cfg, transformer = self.model.config, self.model.transformer
        ffn = self.ffn(PatchOverlay())
        B = len(requests)
        # Every row steps until the last closes: room for the longest prompt and the most tokens asked.
        capacity = max(len(r.ids) for r in requests) + max(r.n for r in requests) + 1
        shape = (B, cfg.n_kv_heads, capacity, cfg.head_dim)
        keys, values = zeroed_layer_pairs(cfg.n_layers, shape)
        tokens = np.zeros(B, np.int64)
        positions = np.zeros(B, np.int64)
        # The prompts run together (model/together.py), each past the prefix it shares with the one before it; a
        # prompt asked twice (for other lengths) runs once.
        runs: list[Run] = []
        run_of: list[int] = []
        for b, r in enumerate(requests):
            if not b or r.ids != requests[b - 1].ids:
                shared = common_prefix(requests[b - 1].ids, r.ids) if b else 0
                runs.append(Run(r.ids[shared:], KvCache(cfg, capacity=len(r.ids) + 1), None,
                                len(runs) - 1 if shared else None, shared))
            run_of.append(len(runs) - 1)
        first = [int(np.argmax(logits)) for logits in forward_together(transformer, runs, ffn)]
        for b, i in enumerate(run_of):
            tokens[b] = first[i]
            kv = runs[i].kv
            for layer in range(cfg.n_layers):
                keys[layer][b, :, :kv.length] = kv.keys[layer][:, :kv.length]
                values[layer][b, :, :kv.length] = kv.values[layer][:, :kv.length]
            positions[b] = kv.length
        stops = self.model.tokenizer.stop_ids
        out: list[list[int]] = [[] for _ in requests]
        open_rows = np.ones(B, bool)
        rows = np.arange(B)            # the request each row of the call decodes
        while True:
            for b, token in zip(rows.tolist(), tokens.tolist()):      # every row of the call is open
                r = requests[b]
                if token in stops:
                    open_rows[b] = False
                    continue
                out[b].append(token)
                # As `greedy`: n tokens at most, and the caller's `enough`.
                if len(out[b]) >= r.n or (r.enough is not None and r.enough(out[b])):
                    open_rows[b] = False
            if not open_rows.any():
                return out
            # A row that has closed leaves the call (its KV rows are dropped): the continuations asked together
            # end at very different lengths (a reply's first words, forty tokens), and a closed row stepping
            # along costs as much as an open one. A row computes the same bits in a call of any size.
            still = np.flatnonzero(open_rows[rows])
            if still.size < rows.size:
                keys, values = [k[still] for k in keys], [v[still] for v in values]
                rows, tokens, positions = rows[still], tokens[still], positions[still]
            h = transformer.embed(tokens)
            if walk_k is None:
                logits = batched.run(h, positions, keys, values, transformer.rope)
            else:       # the head as the single walked step reads it: each row's last residual and FFN output
                # (A layer with a tie at the K-th place, not "settled", is taken as the graph computed it, where the
                # single path computes that layer with the walk's own rule: real gate scores do not tie there.)
                passes = batched.run_walked(h, positions, keys, values, transformer.rope, walk_k)
                logits = transformer.graphs.run_head(np.stack([p.residuals[-1] for p in passes]),
                                                     np.stack([p.outputs[-1] for p in passes]))
            tokens = np.argmax(logits, axis=1)
            positions += 1

    def continuation(self, text: str, overlay: PatchOverlay, n: int = 8) -> tuple[str, list[int]]:
        """Greedy continuation of plain text under the overlay."""
        tokens = self.greedy(self.encode(text), overlay, n)
        return self.model.tokenizer.decode(tokens), tokens

    def base_continuation(self, text: str) -> str:
        """The base model's greedy continuation of `text` (CONTINUATION_TOKENS), remembered: the generic ones
        are the same for every insert of this Inserter, and the decoys for every insert under one relation."""
        return self.model.tokenizer.decode(self.remembered_greedy(self._continued, text, self.encode(text),
                                                                  CONTINUATION_TOKENS))

    def base_inputs(self, ids: Sequence[int], from_layer: int) -> list[np.ndarray | None]:
        """Per layer the normed FFN inputs (T, d) of `ids` under the base weights, from `from_layer` on (None
        before it: INSERT keys only the late half of the network, or from a layer the user pins), remembered.
        Most negatives are captured under the base weights (no earlier fact's feature fires on them; the
        contexts where they do are `written_inputs_all`'), and most are the same from one insert to the next: the
        relation's decoys, the generic sentences, the earlier facts' questions and answers. Least recently used
        forgotten first, within CAPTURE_MEMORY_BYTES; a FIFO of a fixed count forgot each one just before the
        next insert asked again."""
        return self._remembered_capture(ids, from_layer).inputs

    def _remembered_capture(self, ids: Sequence[int], from_layer: int, residual_at: int | None = None
                            ) -> RememberedInputs:
        """`base_inputs`' memory of `ids`, captured now if it is not remembered from `from_layer` on (or, with
        `residual_at`, without the residual at that layer)."""
        key = tuple(ids)
        known = self._recalled(key, from_layer, residual_at)
        if known is not None:
            return known
        return self._kept(key, self.capture(key, PatchOverlay()), from_layer, residual_at)

    def prefetch_inputs(self, wanted: Sequence[tuple[Sequence[int], int, int | None]], stop: "Cancel") -> None:
        """The base passes `_remembered_capture` is about to be asked for ((ids, from_layer, residual_at) each)
        that are neither remembered nor stored, captured together (model/together.py), PREFETCH_CONTEXTS at a
        time: the negatives of an insert under a relation not seen before are ~45 contexts. Each runs whole, as
        `capture` runs it alone (the same bits: what is kept does not depend on which others were missing)."""
        missing: dict[tuple[int, ...], tuple[int, int | None]] = {}
        for ids, from_layer, residual_at in wanted:
            key = tuple(ids)
            if key not in missing and self._recalled(key, from_layer, residual_at) is None:
                missing[key] = (from_layer, residual_at)
        items = list(missing.items())
        for i in range(0, len(items), PREFETCH_CONTEXTS):
            stop.check()
            chunk = items[i:i + PREFETCH_CONTEXTS]
            captured = self.capture_all([key for key, _ in chunk], PatchOverlay(), share_prefixes=False)
            for (key, (from_layer, residual_at)), c in zip(chunk, captured):
                self._kept(key, c, from_layer, residual_at)

    def _recalled(self, key: tuple[int, ...], from_layer: int, residual_at: int | None) -> RememberedInputs | None:
        """The remembered capture of `key` that covers `from_layer` (and `residual_at`), read from the capture
        store into memory if only it holds one; None when neither does."""
        known = self._remembered.get(key)
        if known is not None and _covers(known, from_layer, residual_at):
            self._remembered.move_to_end(key)
            return known
        store, namespace = self.capture_store, self.capture_namespace()
        stored = store.get(namespace, key) if store is not None and namespace is not None else None
        if stored is not None and _covers(stored, from_layer, residual_at):
            return self._remember(key, stored.from_layer, stored.inputs, stored.residual)
        return None

    def _kept(self, key: tuple[int, ...], captured: "Captured", from_layer: int, residual_at: int | None
              ) -> RememberedInputs:
        """A fresh base capture of `key`, remembered and stored from `from_layer` on."""
        # Each layer's inputs are an array of their own (the pass's record), so keeping some lets the rest go.
        # The layer a pass resumes from stays single precision: the resumed layers read it as the pass made it.
        inputs = [None if i < from_layer else x if i == residual_at else x.astype(REMEMBERED_DTYPE)
                  for i, x in enumerate(captured.inputs)]
        residual = None if residual_at is None else (residual_at, captured.residuals[residual_at])
        store, namespace = self.capture_store, self.capture_namespace()
        if store is not None and namespace is not None:
            store.put(namespace, key, StoredCapture(from_layer, inputs, residual))
        return self._remember(key, from_layer, inputs, residual)

    def _remember(self, key: tuple[int, ...], from_layer: int, inputs: list,
                  residual: tuple[int, np.ndarray] | None) -> RememberedInputs:
        self._remembered.pop(key, None)
        nbytes = sum(x.nbytes for x in inputs if x is not None) + (0 if residual is None else residual[1].nbytes)
        self._remembered[key] = remembered = RememberedInputs(from_layer, inputs, nbytes, residual)
        while sum(r.nbytes for r in self._remembered.values()) > CAPTURE_MEMORY_BYTES and len(self._remembered) > 1:
            self._remembered.popitem(last=False)
        return remembered

    def capture_namespace(self) -> str | None:
        """What the base passes' numbers depend on besides their tokens (the capture store's namespace): the model,
        the attention and FFN graphs' content, the walk settings, onnxruntime's version and threads, the rows'
        precision. None where a graph has no such name (the numpy reference, graphs built in memory) or no
        store is given: then nothing is kept on disk."""
        if self.capture_store is None or not self.capture_store.enabled:
            return None
        blocks = getattr(self.model.transformer.graphs, "numerics", None)
        ffn = getattr(self.model.ffn, "numerics", None)
        if blocks is None or ffn is None:
            return None
        return "|".join([self.model.checksum, blocks, ffn, repr(self.walk), f"onnxruntime-{ort.__version__}",
                         f"threads-{self.model.threads}", np.dtype(REMEMBERED_DTYPE).name])

    def written_inputs_all(self, contexts: Sequence[Sequence[int]], overlay: PatchOverlay, from_layer: int,
                           stop: "Cancel | None" = None) -> list[list[np.ndarray | None]]:
        """`base_inputs` of each context where the overlay's features fire (the earlier facts' questions and
        answers), under `overlay`: after an earlier fact writes its answer, the later layers read a residual
        the base model never makes, and a later fact's key solved against base captures alone learned "an
        answer was written here" and fired on every fact's question (SmolLM2, 50 facts: one key at layer 27
        scored -45 on another fact's question in the base model and +13 under the overlay). The layers before
        the overlay's first compute what the base model computes, so each pass resumes there from the
        remembered base capture (a quarter of a pass on SmolLM2, where facts sit at layers 23-26), the passes
        PREFETCH_CONTEXTS at a time together (model/together.py): with fifty facts kept there are ~150."""
        first = self.written_resume_layer(overlay, from_layer)
        if first is None and overlay.overridden_layers:     # a layer pinned below the keys' range: whole passes
            return [[x if i >= from_layer else None for i, x in enumerate(c.inputs)]
                    for c in self.capture_all(contexts, overlay, stop, share_prefixes=False)]
        if first is None:
            return [self.base_inputs(ids, from_layer) for ids in contexts]
        out: list[list[np.ndarray | None]] = []
        for start in range(0, len(contexts), PREFETCH_CONTEXTS):
            if stop is not None:
                stop.check()
            resumed = []
            for ids in contexts[start:start + PREFETCH_CONTEXTS]:
                known = self._remembered_capture(ids, from_layer, residual_at=first)
                assert known.residual is not None
                inputs = list(known.inputs)
                out.append(inputs)
                kv = KvCache(self.model.config, capacity=len(ids) + 2)
                kv.length = len(ids)    # the layers after `first` write their rows anew; the ones before are not read
                resumed.append(Resumed(known.residual[1], known.inputs[first], kv, _replacing(inputs)))
            resume_together(self.model.transformer, first, resumed, self.ffn(overlay))
        return out

    @staticmethod
    def written_resume_layer(overlay: PatchOverlay, from_layer: int) -> int | None:
        """The layer `written_inputs_all` resumes its passes from under `overlay` (its first overridden one); None
        where it resumes none: no override (the base capture is the pass), or one below `from_layer` (the whole
        pass runs under the overlay)."""
        layers = overlay.overridden_layers
        return layers[0] if layers and layers[0] >= from_layer else None

    def capture_all(self, contexts: Sequence[Sequence[int]], overlay: PatchOverlay,
                    stop: "Cancel | None" = None, share_prefixes: bool = True) -> list["Captured"]:
        """`capture` of every context, run together (model/together.py) and each shared prefix run once: the
        contexts are taken in sorted order (where each one's longest common prefix with the ones before it is
        the one with its predecessor) and each runs only its tokens past that prefix, on its predecessor's KV
        rows (the prefix's rows of every layer are the predecessor's: the pass is causal). The positives share
        much: every chat question starts with the template's system turn, and each is captured bare and with
        two or three answer starts (about a third of their tokens are distinct). Without `share_prefixes`, each
        context runs whole, as `capture` runs it alone."""
        if stop is not None:
            stop.check()
        order = sorted(range(len(contexts)), key=lambda i: tuple(contexts[i]))
        runs: list[Run] = []
        recorded: list[tuple[list, list]] = []
        previous: tuple[int, ...] = ()
        for i in order:
            ids = tuple(contexts[i])
            shared = common_prefix(previous, ids) if runs and share_prefixes else 0
            residuals: list[np.ndarray] = []
            inputs: list[np.ndarray] = []
            recorded.append((residuals, inputs))
            runs.append(Run(ids[shared:], KvCache(self.model.config, capacity=len(ids) + 2),
                            _collecting(residuals, inputs), len(runs) - 1 if shared else None, shared))
            previous = ids
        logits = forward_together(self.model.transformer, runs, self.ffn(overlay))
        out: list[Captured | None] = [None] * len(contexts)
        made: list[Captured] = []
        for k, (i, run, (residuals, inputs)) in enumerate(zip(order, runs, recorded)):
            if run.prefix_of is not None:       # the prefix's rows are the predecessor's
                source = made[run.prefix_of]
                residuals = [np.concatenate([h[:run.shared], mine]) for h, mine in zip(source.residuals, residuals)]
                inputs = [np.concatenate([x[:run.shared], mine]) for x, mine in zip(source.inputs, inputs)]
            made.append(Captured(inputs, logits[k], run.kv, residuals))
            out[i] = made[-1]
        return [c for c in out if c is not None]

    def capture(self, ids: Sequence[int], overlay: PatchOverlay) -> Captured:
        """Normed FFN inputs (T, d) of every layer, the last position's logits and the KV cache, for one context.
        Users of the KV cache truncate it to the length they need first."""
        return self.capture_all([ids], overlay, share_prefixes=False)[0]

    @staticmethod
    def _first_changed(captured: "Captured", layer: int, added: Sequence[PatchOperation]) -> int | None:
        """The first position of `captured` whose pass changes when `added` (gated features at `layer`) join the
        overlay: the first where one of them fires; None where none does. 0 when `added` is not only that."""
        if not (added and all(op.layer == layer and op.gate_bias is not None for op in added)):
            return 0
        x = captured.inputs[layer]
        fires = np.zeros(x.shape[0], bool)
        for op in added:
            # A hair below zero counts too: the overlay computes the same score in its own order of sums.
            fires |= x @ op.gate + np.float32(op.gate_bias) > -FIRING_TOLERANCE
        return int(np.argmax(fires)) if fires.any() else None

    def recapture_all(self, contexts: Sequence[Sequence[int]], captured: Sequence["Captured"], layer: int,
                      overlay: PatchOverlay, added: Sequence[PatchOperation] = ()) -> list["Captured"]:
        """Each of `captured` (of `contexts`, under an overlay that differed from `overlay` only at `layer` and
        later) brought up to `overlay`: the layers after `layer` re-run from its recorded state, the ones before
        kept. A few of 30 layers instead of a whole pass per context, each time INSERT adds a layer's write.
        With `added` (the gated features `overlay` adds at `layer`, and nothing else changed), only the
        positions from the first where one of them holds its slot are re-run: the ones before compute what they
        computed (an inserted feature leaves its slot to the base feature where its gate is not positive, and a
        position depends on none after it), and they are most of a context, since a key fires where the answer
        starts. The passes run together (model/together.py)."""
        out: list[Captured | None] = list(captured)
        resumed, where, whole = [], [], []
        for k, (ids, c) in enumerate(zip(contexts, captured)):
            first = self._first_changed(c, layer, added)
            if first is None:
                continue
            c.kv.truncate(min(c.kv.length, len(ids)))
            if c.kv.length != len(ids):      # a balance trial left the last position out: run it whole
                whole.append(k)
                continue
            inputs = [x if i <= layer else x[:first] for i, x in enumerate(c.inputs)]
            residuals = [h if i <= layer else h[:first] for i, h in enumerate(c.residuals)]
            resumed.append(Resumed(c.residuals[layer][first:], c.inputs[layer][first:], c.kv,
                                   _appending(residuals, inputs)))
            where.append((k, inputs, residuals))
        for (k, inputs, residuals), logits in zip(where, resume_together(self.model.transformer, layer, resumed,
                                                                          self.ffn(overlay))):
            out[k] = Captured(inputs, logits, captured[k].kv, residuals)
        for k, c in zip(whole, self.capture_all([contexts[k] for k in whole], overlay)):
            out[k] = c
        return [c for c in out if c is not None]

    def extend_all(self, contexts: Sequence[Sequence[int]], captured: Sequence["Captured"], more: Sequence[int],
                   overlay: PatchOverlay, copy_caches: bool = False) -> list["Captured"]:
        """The captures of each context + `more`, from its capture in `captured` (under `overlay`) and a pass over
        `more` on its KV cache, the passes run together. The caches are shared with `captured` (their later
        positions are rewritten) unless `copy_caches`: then each extension runs on a copy of its context's rows,
        and `captured` may be extended by other tokens too."""
        out: list[Captured | None] = [None] * len(contexts)
        runs, where, whole = [], [], []
        for k, (ids, c) in enumerate(zip(contexts, captured)):
            c.kv.truncate(min(c.kv.length, len(ids)))
            if c.kv.length != len(ids) or not more:
                whole.append(k)
                continue
            kv = c.kv
            if copy_caches:
                kv = KvCache(self.model.config, capacity=len(ids) + len(more) + 2)
                kv.copy_prefix(c.kv, len(ids))
            inputs, residuals = list(c.inputs), list(c.residuals)
            runs.append(Run(more, kv, _appending(residuals, inputs)))
            where.append((k, inputs, residuals, kv))
        for (k, inputs, residuals, kv), logits in zip(where, forward_together(self.model.transformer, runs,
                                                                              self.ffn(overlay))):
            out[k] = Captured(inputs, logits, kv, residuals)
        for k, c in zip(whole, self.capture_all([tuple(contexts[k]) + tuple(more) for k in whole], overlay)):
            out[k] = c
        return [c for c in out if c is not None]


def _collecting(residuals: list, inputs: list) -> LayerRecord:
    """A `record` that lists each layer's rows (called once per layer, in order)."""
    def record(i, h, x):
        residuals.append(h)
        inputs.append(x)
    return record


def _replacing(inputs: list) -> LayerRecord:
    """A `record` that puts each layer's new inputs in place of the ones kept."""
    def record(i, h, x):
        inputs[i] = x
    return record


def _appending(residuals: list, inputs: list) -> LayerRecord:
    """A `record` that appends each layer's new rows to the ones kept (none kept: the new rows alone)."""
    def record(i, h, x):
        residuals[i] = np.concatenate([residuals[i], h]) if len(residuals[i]) else h
        inputs[i] = np.concatenate([inputs[i], x]) if len(inputs[i]) else x
    return record
