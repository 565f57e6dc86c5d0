"""LARQL's walk FFN through its FFN activation cache (L1 per session, L2 per process, optional persistent L3).

The key is made in keys.py, the tiers and the rule for serving a hit live in tiers.py, the counts in stats.py
and the persistent store in l3/ (codec, contract, SQLite and Redis backends); this module is the walk itself and
where it consults them.

Per layer, the gate KNN maps the normed FFN input to the top-K features by |gate score|; the cache key is a
64-bit hash of that set of feature ids (keys.py), so two residuals that select the same features share an entry. Only
single-position calls (decode) consult the cache; prefill, the full-K dense rewrite and layers carrying
INSERT overrides bypass it, each counted by reason.

A decode step runs in one call of a whole-model graph where it can: the served decoder when the key trace names
every layer's entry in advance (`plan_step` / `settle_step`; the replay decoder, without the gate, while the steps
repeat earlier ones bit for bit: `settle_replayed_step`), else the walked decoder, which computes the top-K
walk at every layer and leaves the keys, lookups and stores of the misses to after the call
(`walk_step_k` / `settle_walked_step`). Both keep only the layers a layer-by-layer walk would have given the
same output, and the step goes on layer by layer from the first other one.

Beyond the seed (see shared/notes/larql-reference.md for the holes in LARQL's own code):
  * entries are namespaced by model checksum, K, key width and the graphs' numerics, and only feature sets no
    INSERT override touches are looked up, so a hit never serves an output computed under another model, K,
    patch state or version of the graphs;
  * `lru` eviction and a byte budget besides the seed's `drop` policy; overwriting a key is never dropped;
  * a hit is served only when the entry was computed from (nearly) the same input (`HitRule`): the seed's
    key alone lets a request for 3x store its output where the next request for x finds it;
  * key width k' <= K and an optional cosine guard with small buckets (the key-stability question);
  * a verify mode that recomputes a fraction of hits and records the error a hit really carries;
  * an optional L3 (l3/: SQLite or Redis) consulted after L2; its hits fill L2 and L1, misses write back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from larql_desktop.engine.cache.keys import (default_top_k, feature_key, is_full_k, key_features, mask_key,
                                             packed_mask_key, select_mask)
from larql_desktop.engine.cache.near_miss import NearMissSampler
from larql_desktop.engine.cache.stats import WalkObserver
from larql_desktop.engine.cache.trace import KeyTrace
from larql_desktop.engine.cache.tiers import DEFAULT_MAX_DISTANCE, CacheEntry, CacheTier, HitRule, PersistentTierView, frozen_copy
from larql_desktop.engine.model.config import ModelConfig
from larql_desktop.engine.model.transformer import ACTIVATIONS, PassAwareFfn
from larql_desktop.engine.model.overlay import PatchOverlay

PATCH_MODES = ("bypass", "per_feature")


@dataclass(frozen=True)
class ServedStep:
    """A decode step's guessed hits: per layer the key and its selection, its entry and the index of the tier
    that holds it, the entries' outputs stacked (n_layers, d) for the served decoder graph and their inputs
    (n_layers, d) to check the step against, and whether the step is expected to replay an earlier one bit for
    bit (run in the replay decoder, which computes no gate)."""
    start: tuple             # the trace's link to the first layer's key: the previous step's end and the token
    keys: tuple
    packed: tuple            # each key's selection mask (F,) packed as mask_key packs it (F/8 uint8)
    selections: np.ndarray   # the same unpacked: (n_layers, F) bool
    entries: tuple
    found_in: tuple
    outputs: np.ndarray
    residuals: np.ndarray
    replay: bool


@dataclass(frozen=True)
class WalkSettings:
    top_k: int | None = None          # None: the seed's ratio (79% of the intermediate size)
    dense: bool = False               # plain dense FFN, no KNN, no cache
    key_width: int | None = None      # k' <= K ids in the key; None = K (the seed)
    cosine_guard: float | None = None  # tau: a hit needs cos(x, x0) >= tau (and norms within 5%): approximate
    bucket_size: int = 4              # entries per key when the guard is on
    # Without a guard, a hit needs |x - x0| <= max_distance * |x| (see DEFAULT_MAX_DISTANCE for the measurement).
    max_distance: float = DEFAULT_MAX_DISTANCE
    # The seed's pure feature-set semantics: any entry under the key is served, whatever input made it. For
    # study only: UNSAFE with untrusted clients (an HTTP client could choose what the app's chats are served),
    # so API requests never run with it.
    feature_set_hits: bool = False
    verify_fraction: float = 0.0      # share of hits recomputed to measure their error
    verify_seed: int = 0
    # "bypass": the seed's rule, layers with INSERT overrides skip L1 and L2. "per_feature": such a layer
    # still uses the cache when the selected features include no overridden one (ADR open question 3).
    patch_mode: str = "bypass"
    # Dense passes (dense settings, no INSERT overrides) may run as one call of the whole-model decoder graph,
    # and a walk's decode steps as one call of the walked decoder graph; False keeps both layer by layer (the
    # bench's like-for-like baseline for the cache, and what the tests compare the one-call steps with).
    whole_model_graph: bool = True
    # Near-miss explanation (engine/cache/near_miss.py): share of misses explained (0: off), and the guard tau
    # it judges them by when cosine_guard is None.
    near_miss_fraction: float = 0.0
    near_miss_tau: float = 0.995

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"K must be at least 1, not {self.top_k}")
        if self.key_width is not None and self.key_width < 1:
            raise ValueError(f"key width must be at least 1, not {self.key_width}")
        if self.cosine_guard is not None and not (-1.0 <= self.cosine_guard <= 1.0):
            raise ValueError(f"cosine guard must be within [-1, 1], not {self.cosine_guard}")
        if not 0.0 <= self.max_distance <= 1.0:       # NaN fails too
            raise ValueError(f"maximum input distance must be within [0, 1], not {self.max_distance}")
        if not 1 <= self.bucket_size <= 256:
            raise ValueError(f"bucket size must be between 1 and 256, not {self.bucket_size}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify fraction must be within [0, 1], not {self.verify_fraction}")
        if not 0.0 <= self.near_miss_fraction <= 1.0:
            raise ValueError(f"near-miss fraction must be within [0, 1], not {self.near_miss_fraction}")
        if not -1.0 <= self.near_miss_tau <= 1.0:
            raise ValueError(f"near-miss tau must be within [-1, 1], not {self.near_miss_tau}")
        if self.patch_mode not in PATCH_MODES:
            raise ValueError(f"patch mode must be one of {', '.join(PATCH_MODES)}, not {self.patch_mode!r}")

    def sizes(self, intermediate: int) -> tuple[int, int]:
        """(K, key width) for a model of `intermediate` features per layer, defaults filled in; ValueError if
        either does not fit."""
        k = default_top_k(intermediate) if self.top_k is None else self.top_k
        if k > intermediate:
            raise ValueError(f"K={k} exceeds the model's {intermediate} features per layer")
        width = k if self.key_width is None else self.key_width
        if width > k:
            raise ValueError(f"key width {width} exceeds K={k}")
        return k, width

    def resolved(self, intermediate: int) -> "WalkSettings":
        k, width = self.sizes(intermediate)
        return replace(self, top_k=k, key_width=width)

    @property
    def hit_rule(self) -> HitRule:
        if self.cosine_guard is not None:
            return HitRule("cosine", tau=self.cosine_guard)
        if self.feature_set_hits:
            return HitRule("feature_set")
        return HitRule("near", max_distance=self.max_distance)


class FfnGraphs(Protocol):
    config: ModelConfig   # its activation name is used for overridden features
    numerics: str    # names how the graphs compute (export format): part of every cache key's namespace

    def gate_scores(self, layer: int, x: np.ndarray) -> np.ndarray: ...
    def walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray) -> np.ndarray: ...
    def dense(self, layer: int, x: np.ndarray) -> np.ndarray: ...
    def walk_top_k(self, layer: int, x: np.ndarray, k: int) -> np.ndarray: ...


class WalkFfn(PassAwareFfn):
    """The FfnCall of one session: sparse walk over the top-K features, through L1 then L2.

    INSERT overrides (a PatchOverlay) are applied on top of the base graphs: overridden features get patched
    gate scores before selection, are masked out of the base walk and added back from their override vectors.
    """

    def __init__(self, graphs: FfnGraphs, intermediate: int, model_checksum: str, settings: WalkSettings,
                 l1: CacheTier | None, l2: CacheTier | None, stats: tuple[WalkObserver, ...],
                 patches: PatchOverlay | None = None, key_log: list | None = None, l3=None,
                 trace: KeyTrace | None = None):
        self.graphs = graphs
        # Which key followed which (shared by the engine's walks): lets a decode step whose every layer will hit
        # be named in advance and run in one call (plan_step / settle_step). None: every step runs layer by layer.
        self.trace = trace
        self._step_start = None      # the trace's link to this step's layer-0 key (set by plan_step)
        self._previous = None        # (layer, key) of this walk's latest decode lookup
        self._last_step_key = None   # the last layer's key of the previous step (or of a prefill's last row)
        self.steps_served = 0        # decode steps planned and served whole in one call
        self.steps_resumed = 0       # planned steps in which a guess failed: computed on from that layer
        self.steps_walked = 0        # decode steps computed whole in one call of the walked decoder graph
        self.steps_replayed = 0      # served steps whose every input was its entry's, bit for bit (no gate run)
        # Whether the next planned step is expected to replay an earlier one bit for bit: so from each new prompt
        # until a replay finds an input that differs (the served decoder checks the keys from the scores then).
        self._replays = True
        self.l3 = l3             # an l3.L3Store (persistent tier after L2) or None
        self._l3_tier = PersistentTierView(l3, graphs.config.n_layers) if l3 is not None else None
        # Outcome of the latest call ("hit", "miss", "bypass", "dense"), the tier that hit and the bypass reason:
        # for callers that report per call (the HTTP API builds one WalkFfn per request).
        self.last_outcome: str | None = None
        self.last_tier: str | None = None
        self.last_bypass: str | None = None
        self.key_log = key_log   # when a list: (layer, key) of every cache lookup, for offline analysis
        self.intermediate = intermediate
        self.settings = settings.resolved(intermediate)
        self.top_k, self.key_width = settings.sizes(intermediate)   # the same as settings' own, typed int
        self._hit_rule = self.settings.hit_rule
        self.model_checksum = model_checksum
        self.l1, self.l2 = l1, l2
        self.stats = stats      # the observers each call's outcome is reported to (statistics, recorders)
        self.patches = patches if patches is not None else PatchOverlay()
        self.full_k = is_full_k(self.settings.top_k, intermediate)
        self.activation = ACTIVATIONS[graphs.config.activation]
        self._rng = np.random.default_rng(self.settings.verify_seed)
        s = self.settings
        self.near_miss = None if not s.near_miss_fraction else NearMissSampler(
            s.near_miss_fraction, s.cosine_guard if s.cosine_guard is not None else s.near_miss_tau,
            intermediate, s.top_k, seed=s.verify_seed)

    def add_observer(self, observer: WalkObserver) -> None:
        """Report every later call's outcome to `observer` too (once, however often it is added)."""
        if observer not in self.stats:
            self.stats = self.stats + (observer,)

    def namespace(self) -> tuple:
        """What an entry's output depends on besides the feature key: the model, K, key width and the graphs'
        numerics (a persistent L3 entry computed by older or corrupt graphs is never served to the repaired ones).
        No patch state: a feature set that an INSERT override touches never reaches a lookup (the layer bypasses,
        or in per-feature mode that one call does), so every cached output is a function of the base weights."""
        s = self.settings
        return (self.model_checksum, s.top_k, s.key_width, self.graphs.numerics)

    def _record(self, layer, outcome, started, **kw):
        seconds = None if started is None else time.perf_counter() - started
        self.last_outcome, self.last_bypass = outcome, kw.get("bypass")
        results = kw.get("tier_results", ())
        self.last_tier = results[-1][0] if outcome == "hit" and results else None
        for st in self.stats:
            st.record(layer, outcome, seconds, **kw)

    def selection_mask(self, scores: np.ndarray) -> np.ndarray:
        """(T, F) 0/1 float mask of the top-K features per position: what the walk graph sums over."""
        k = self.settings.top_k
        return np.stack([select_mask(row, k) for row in scores]).astype(np.float32)

    def mask_for(self, scores: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(T, F) 0/1 mask of the top-K features per position, and each position's selection (ascending ids)."""
        mask = self.selection_mask(scores)
        return mask, [np.flatnonzero(row) for row in mask]

    def overrides_at(self, layer: int, x: np.ndarray):
        """The INSERT overrides of `layer` as they stand for inputs `x`: (overrides or None, their gate scores
        under the overlay (T, n), where each override holds its slot (T, n) bool); what the feature view shows."""
        return self._patched(layer, x)

    def _patched(self, layer: int, x: np.ndarray):
        """(overrides or None, their gate scores under the overlay (T, n), where each override holds its slot)."""
        ovr = self.patches.layer(layer)
        if ovr is None:
            return None, None, None
        patched = x @ ovr.gate.T + ovr.gate_bias
        # An inserted (gated) feature takes over its slot only where its biased gate score is positive; elsewhere
        # the slot keeps its base feature, so unrelated inputs compute exactly what the base model computes.
        # Plain overrides (no bias) replace their feature everywhere.
        return ovr, patched, (patched > 0.0) | ~ovr.gated

    def gate_knn(self, layer: int, x: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per position, the features the walk actually sums (the selected base features, with overridden
        slots replaced where their override holds) strongest first, and the gate scores it uses for them."""
        scores = self.graphs.gate_scores(layer, x)
        mask = self.selection_mask(scores)
        ovr, patched, holds = self._patched(layer, x)
        if ovr is not None:
            scores[:, ovr.features] = np.where(holds, patched, scores[:, ovr.features])
            mask[:, ovr.features] = np.maximum(mask[:, ovr.features], holds)
        result = []
        for t in range(x.shape[0]):
            ids = np.flatnonzero(mask[t])
            ids = ids[np.argsort(-np.abs(scores[t, ids]), kind="stable")]
            result.append((ids, scores[t, ids]))
        return result

    def _walk(self, layer: int, x: np.ndarray, scores: np.ndarray, mask: np.ndarray, patched=None) -> np.ndarray:
        """Base walk over `mask`, with each overridden slot computed from its override where that holds."""
        ovr, patched_scores, holds = patched if patched is not None else self._patched(layer, x)
        if ovr is None or not holds.any():
            return self.graphs.walk(layer, x, scores, mask)
        base_mask = mask.copy()
        base_mask[:, ovr.features] *= ~holds
        out = self.graphs.walk(layer, x, scores, base_mask)
        act = self.activation(patched_scores) * (x @ ovr.up.T) * holds       # (T, n)
        return out + act @ ovr.down                                          # (T, d)

    def dense(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The dense FFN under the current overlay."""
        if self.patches.layer(layer) is None:
            return self.graphs.dense(layer, x)
        ones = np.ones((x.shape[0], self.intermediate), np.float32)
        return self._walk(layer, x, self.graphs.gate_scores(layer, x), ones)

    def runs_plain_dense(self) -> bool:
        """Whether the model may run a whole pass as the plain dense model, all layers in one decoder-graph call:
        yes under dense settings (or a K so large the walk is dense anyway) with no INSERT override on any layer."""
        s = self.settings
        return s.whole_model_graph and (s.dense or self.full_k) and not self.patches.overridden_layers

    def record_dense_pass(self) -> None:
        """A pass ran in the decoder graph: a "dense" outcome per layer, untimed (one call ran them all)."""
        bypass = None if self.settings.dense else "full_k"
        for layer in range(self.graphs.config.n_layers):
            self._record(layer, "dense", None, bypass=bypass)

    def _lookup_tiers(self) -> list:
        """The enabled tiers, in lookup order (L1, L2, then L3)."""
        tiers = [t for t in (self.l1, self.l2) if t is not None and t.settings.enabled]
        if self._l3_tier is not None and self._l3_tier.enabled:
            tiers.append(self._l3_tier)
        return tiers

    def _selects_in_graph(self) -> bool:
        """Every tier off and no INSERT override anywhere: nothing needs the scores or the selection in Python,
        so each layer runs as one call of the top-K walk graph (selection and mask inside it)."""
        return not self.patches.overridden_layers and not self._lookup_tiers()

    @property
    def takes_gate_scores(self) -> bool:
        """The walk starts from the gate scores: the model may hand them over from the layer graph's call
        (`call_with_scores`) rather than have them computed by a call of their own. Not with the cache off:
        then the top-K walk graph computes them itself."""
        return not (self.settings.dense or self.full_k or self._selects_in_graph())

    def takes_gate_scores_for(self, rows: int) -> bool:
        """Prefill takes the layer graph's scores even with the cache off: onnxruntime's TopK costs ~36 us a
        row (56 rows: 2 ms per layer, more than the gate product and the Python selection together), so the
        top-K walk graph runs only for decode (one row: ~10 us)."""
        if self.settings.dense or self.full_k:
            return False
        return rows > 1 or self.takes_gate_scores

    def __call__(self, layer: int, x: np.ndarray) -> np.ndarray:
        return self.call_with_scores(layer, x, None)

    def call_with_scores(self, layer: int, x: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
        """The FFN at `layer` for x; `scores`: x @ W_gate.T of the base weights when the caller has them."""
        started = time.perf_counter()
        s = self.settings
        if s.dense or self.full_k:
            out = self.dense(layer, x)
            self._record(layer, "dense", started, bypass=None if s.dense else "full_k")
            return out
        tiers = self._lookup_tiers()
        if scores is None and not tiers and self.patches.layer(layer) is None:
            out = self.graphs.walk_top_k(layer, x, s.top_k)     # the same features and output as below
            self._record(layer, "bypass", started, bypass="prefill" if x.shape[0] != 1 else "cache_off")
            return out
        # Gate KNN: the base features compete exactly as in the base model (an overridden slot keeps its base
        # score in the ranking), so a patch never reshuffles which base features are selected.
        if scores is None:
            scores = self.graphs.gate_scores(layer, x)
        patched = self._patched(layer, x)
        ovr, _, holds = patched
        touched = ovr is not None and bool(holds.any())
        if x.shape[0] != 1:
            bypass = "prefill"
        elif ovr is not None and (s.patch_mode == "bypass" or touched):
            bypass = "patched"
        else:
            bypass = None if tiers else "cache_off"
        if bypass is not None:
            out = self._walk(layer, x, scores, self.selection_mask(scores), patched)
            self._record(layer, "bypass", started, bypass=bypass)
            self._previous = None
            if bypass == "prefill":
                self._replays = True
            if layer == self._n_layers - 1:
                # A step after a prefill starts from the prompt's last position: that position's key names where
                # the step begins. After a patched decode step nothing does.
                self._last_step_key = (self._key_of(scores[-1])[0] if bypass == "prefill" and self.trace is not None
                                       else None)
            return out
        # Only untouched feature sets reach here: their output depends on the base weights alone.
        key, selected = self._key_of(scores[0])
        if self.key_log is not None:
            self.key_log.append((layer, key))
        self._link(layer, key, selected)
        x0 = x[0]
        rule = self._hit_rule
        bucket = s.bucket_size if s.cosine_guard is not None else 1
        results = []
        for i, tier in enumerate(tiers):
            entry = tier.lookup(layer, key, x0, rule)
            results.append((tier.name, entry is not None))
            if entry is not None:
                for upper in tiers[:i]:           # a hit fills the tiers above it
                    upper.store(layer, key, entry, bucket)
                self._record(layer, "hit", started, tier_results=tuple(results))
                if s.verify_fraction and self._rng.random() < s.verify_fraction:
                    self._verify(layer, x, scores, selected[None].astype(np.float32), entry)   # not timed
                return entry.output[None, :].copy()
        out = self._walk(layer, x, scores, selected[None].astype(np.float32), patched)
        # An overflowed output (an absurd input, a broken graph) is returned as computed but never stored: a
        # cache holds only what a later hit may serve.
        entry = None
        if np.isfinite(out).all():
            bits = None if self.near_miss is None else self.near_miss.bits(np.flatnonzero(selected))
            entry = CacheEntry(frozen_copy(out[0]), frozen_copy(x0), bits)
            for tier in tiers:
                tier.store(layer, key, entry, bucket)
        self._record(layer, "miss", started, tier_results=tuple(results))
        if self.near_miss is not None and entry is not None:
            self.near_miss.after_miss(layer, started, x0, out[0], entry, tiers, key[0], self.stats)
        return out

    def _key_of(self, scores: np.ndarray) -> tuple[tuple, np.ndarray]:
        """The cache key of one position's base gate scores (F,), and its selection mask: packed from the mask
        itself (no ids) unless the key is built from fewer features than K."""
        s = self.settings
        selected = select_mask(scores, s.top_k)
        if s.key_width >= s.top_k:
            return (self.namespace(), mask_key(selected)), selected
        return (self.namespace(), feature_key(key_features(scores, np.flatnonzero(selected), s.key_width))), selected

    @property
    def _n_layers(self) -> int:
        return self.graphs.config.n_layers

    # -- whole steps of hits (the served decoder graph) ----------------------------------------------------
    def _link(self, layer: int, key, selected: np.ndarray) -> None:
        """Note in the trace that `key`, of the selection mask `selected` (F,) or its packed bits, was looked up
        at `layer` after this walk's previous lookup."""
        if self.trace is None:
            return
        if layer == 0:
            previous, self._step_start = self._step_start, None
        else:
            previous = self._previous if self._previous is not None and self._previous[0] == layer - 1 else None
        if previous is not None:
            packed = selected if selected.dtype == np.uint8 else np.packbits(selected, bitorder="little")
            self.trace.link(previous, (key, packed))
        self._previous = (layer, key)
        if layer == self._n_layers - 1:
            self._last_step_key = key

    def _serves_steps(self) -> bool:
        """Whether a whole step may be served from a plan: a cache to serve from, one entry per key (no guard
        bucket to choose within by the input), no INSERT override anywhere, no hit to verify."""
        s = self.settings
        return (self.trace is not None and not (s.dense or self.full_k) and s.cosine_guard is None
                and not s.verify_fraction and not self.patches.overridden_layers and bool(self._lookup_tiers()))

    def pass_end(self):
        return self._last_step_key

    def continue_after(self, pass_end) -> None:
        self._last_step_key = pass_end
        self._replays = True

    def plan_step(self, token: int) -> "ServedStep | None":
        """Every layer's entry for a decode step of `token`, guessed by following the trace from the previous
        step's last key and the token, when each guessed key has an entry in some tier; else None."""
        # Where the previous step ended is unknown (a new walk, a patched pass): no link is made from here, as
        # one from "nowhere" would name the entries of whatever step last began there.
        start = None if self._last_step_key is None else ("step", self._last_step_key, int(token))
        self._step_start = start
        if start is None or not self._serves_steps():
            return None
        n = self._n_layers
        chain = self.trace.follow_chain(start, n, lambda layer, following: (layer, following[0]))
        namespace = self.namespace()
        if chain is None or any(key[0] != namespace for key, _ in chain):   # links made under other settings
            return None
        keys = tuple(key for key, _ in chain)
        entries: list = [None] * n
        found_in = [0] * n
        missing = list(range(n))
        for i, tier in enumerate(self._lookup_tiers()):    # each tier once, for the layers the ones above lack
            for layer, entry in zip(missing, tier.newest_many([(layer, keys[layer]) for layer in missing])):
                if entry is not None:      # its input is checked once the step has run
                    entries[layer], found_in[layer] = entry, i
            missing = [layer for layer in missing if entries[layer] is None]
            if not missing:
                break
        else:
            return None
        packed = tuple(selection for _, selection in chain)
        masks = np.unpackbits(np.stack(packed), axis=1, count=self.intermediate, bitorder="little")
        return ServedStep(start, keys, packed, masks.view(bool), tuple(entries), tuple(found_in),
                          np.stack([e.output for e in entries]), np.stack([e.residual for e in entries]),
                          self._replays)

    def settle_step(self, step: "ServedStep", ran) -> int:
        """Check each layer's guessed entry against the step as it ran: served where its key is the key of the
        layer's scores and the hit rule lets it serve the layer's input (what a lookup would serve), recorded as
        that tier's hit (untimed: one call ran the step) and filling the tiers above it. Stops at the first
        layer where a guess fails: the model computes from there, and that layer's lookup is its own."""
        holds = self._keys_hold(step, ran.scores, ran.settled) & self._hit_rule.admits(ran.inputs, step.residuals)
        return self._serve_layers(step, holds)

    def settle_replayed_step(self, step: "ServedStep", ran) -> int:
        """As `settle_step` for a step the replay decoder ran (no gate scores): a layer is served where its input
        is, bit for bit, the input its entry was computed from. The same graphs on the same input give the same
        scores, so the key of the layer's scores is the entry's key (under which the walk stored it), and the
        hit rule admits an input at distance 0: what a lookup would serve. At the first other layer the model
        computes on (that layer's lookup makes its own scores), and the next steps run in the served decoder,
        which checks each key from the scores, until the next prompt."""
        same = (ran.inputs.view(np.uint32) == step.residuals.view(np.uint32)).all(axis=1)
        served = self._serve_layers(step, same & self._hit_rule.admits(ran.inputs, step.residuals))
        if served == len(step.keys):
            self.steps_replayed += 1
        else:
            self._replays = False
        return served

    def _serve_layers(self, step: "ServedStep", holds: np.ndarray) -> int:
        """The layers of a planned step before the first whose guess does not hold (`holds`, (n_layers,) bool)
        take their guessed entries: counted as hits of the tiers that held them (untimed: one call ran the
        step), linked in the trace, filling the tiers above them. Returns how many."""
        served = len(step.keys) if holds.all() else int(np.argmin(holds))
        tiers = self._lookup_tiers()
        if served == len(step.keys):
            self.steps_served += 1
        else:
            self.steps_resumed += 1
        if not served:
            return 0
        layers = range(served)
        keys = step.keys
        # The links that named these layers, followed again (kept as recent), and where the next step starts.
        self.trace.link_many([(step.start, (keys[0], step.packed[0]))] +
                             [((layer - 1, keys[layer - 1]), (keys[layer], step.packed[layer]))
                              for layer in range(1, served)])
        self._step_start = None
        self._previous = (served - 1, keys[served - 1])
        if served == self._n_layers:
            self._last_step_key = keys[-1]
        if self.key_log is not None:
            self.key_log.extend((layer, keys[layer]) for layer in layers)
        for i, upper in enumerate(tiers[:-1]):       # a hit fills the tiers above it
            fills = [(layer, keys[layer], step.entries[layer]) for layer in layers if step.found_in[layer] > i]
            if fills:
                upper.store_many(fills)
        results = [tuple((t.name, i == found) for i, t in enumerate(tiers[:found + 1])) for found in range(len(tiers))]
        hits = [(layer, "hit", results[step.found_in[layer]], None) for layer in layers]
        for st in self.stats:
            st.record_untimed(hits)
        self.last_outcome, self.last_bypass, self.last_tier = "hit", None, tiers[step.found_in[served - 1]].name
        return served

    def _keys_hold(self, step: "ServedStep", scores: np.ndarray, settled: np.ndarray) -> np.ndarray:
        """Per layer, whether the key of its scores is the guessed key. Where the guessed selection is the
        scores' top K with no tie at the K-th place (`settled`, checked in the graph), it is: the key is a
        function of the selection. Elsewhere, and for keys of fewer features than K, the key is made and
        compared."""
        s = self.settings
        holds = settled.copy() if s.key_width >= s.top_k else np.zeros(len(step.keys), bool)
        for layer in np.flatnonzero(~holds):
            holds[layer] = self._key_of(scores[layer])[0] == step.keys[layer]
            if not holds[layer]:
                break              # the step is served up to here: the layers after it do not matter
        return holds

    # -- whole steps of the walk (the walked decoder graph) -------------------------------------------------
    def walk_step_k(self) -> int | None:
        """K when a decode step may run whole in the walked decoder graph: the walk, no INSERT override anywhere,
        and none of the per-layer work a lookup can need before its layer's FFN runs or after a miss (a guard's
        bucket chosen by the input, hits to verify, near-miss explanations)."""
        s = self.settings
        if (not s.whole_model_graph or s.dense or self.full_k or self.patches.overridden_layers
                or s.cosine_guard is not None or s.verify_fraction or self.near_miss is not None):
            return None
        return s.top_k

    def settle_walked_step(self, ran) -> int:
        """Take the layers of a step the walked decoder computed as this walk's own, from the first. With the cache
        off, all of them: the per-layer path runs the same top-K walk graph. With tiers, each layer's key is made
        from its selection and looked up in every tier at once; the layers before the first that a lookup would
        serve, or whose selection ties at the K-th place (where the walk's own choice is made in Python), are the
        misses they were: recorded (untimed: one call ran the step), linked in the trace and stored. The model
        computes on from that layer, whose lookup is its own."""
        n = self._n_layers
        tiers = self._lookup_tiers()
        if not tiers:
            records = [(layer, "bypass", (), "cache_off") for layer in range(n)]
            for st in self.stats:
                st.record_untimed(records)
            self.last_outcome, self.last_bypass, self.last_tier = "bypass", "cache_off", None
            self._previous = self._last_step_key = None
            self.steps_walked += 1
            return n
        s = self.settings
        kept = n if ran.settled.all() else int(np.argmin(ran.settled))
        if not kept:
            return 0
        packed = np.packbits(ran.selections[:kept], axis=1, bitorder="little")
        if s.key_width >= s.top_k:
            namespace = self.namespace()
            keys = [(namespace, packed_mask_key(row)) for row in packed]
        else:
            keys = [self._key_of(ran.scores[layer])[0] for layer in range(kept)]
        for tier in tiers:          # the first layer some tier would serve ends what the step keeps
            entries = tier.newest_many([(layer, keys[layer]) for layer in range(kept)])
            found = [layer for layer, entry in enumerate(entries) if entry is not None]
            if found:
                admitted = self._hit_rule.admits(ran.inputs[found], np.stack([entries[i].residual for i in found]))
                if admitted.any():
                    kept = found[int(np.argmax(admitted))]
                    if not kept:
                        return 0
        layers = range(kept)
        # An overflowed output is kept as computed but never stored: a cache holds only what a later hit may serve.
        finite = np.isfinite(ran.outputs[:kept]).all(axis=1)
        stored = [(layer, keys[layer], CacheEntry(frozen_copy(ran.outputs[layer]), frozen_copy(ran.inputs[layer])))
                  for layer in layers if finite[layer]]
        for tier in tiers:
            tier.store_many(stored)
        if self.trace is not None:
            links = [] if self._step_start is None else [(self._step_start, (keys[0], packed[0]))]
            self.trace.link_many(links + [((layer - 1, keys[layer - 1]), (keys[layer], packed[layer]))
                                          for layer in range(1, kept)])
        self._step_start = None
        self._previous = (kept - 1, keys[kept - 1])
        if kept == n:
            self._last_step_key = keys[-1]
            self.steps_walked += 1
        if self.key_log is not None:
            self.key_log.extend((layer, keys[layer]) for layer in layers)
        misses = tuple((tier.name, False) for tier in tiers)
        for st in self.stats:
            st.record_untimed([(layer, "miss", misses, None) for layer in layers])
        self.last_outcome, self.last_bypass, self.last_tier = "miss", None, None
        return kept

    def _verify(self, layer, x, scores, mask, entry: CacheEntry) -> None:
        """Fidelity: the hit against a fresh computation at this input. Staleness: the entry against a fresh
        computation at the input it was made from, under the current weights and patches (must be exact)."""
        cached = entry.output
        fresh = self._walk(layer, x, scores, mask)[0]
        denom = float(np.linalg.norm(fresh) * np.linalg.norm(cached))
        cosine = float(fresh @ cached) / denom if denom else 1.0
        max_abs = float(np.max(np.abs(fresh - cached)))
        x0 = entry.residual[None, :]
        scores0 = self.graphs.gate_scores(layer, x0)
        remade = self._walk(layer, x0, scores0, self.selection_mask(scores0))[0]
        stale = float(np.max(np.abs(remade - cached)))
        for st in self.stats:
            st.record_fidelity(cosine, max_abs, stale)
