"""The walk's whole decode steps: which passes of a walk may run in one call of a whole-model decoder graph
(graphs/decoder.py), and what the walk makes of what such a call computed. The model hands a pass to the stepper
its FFN brings (model/transformer.py `Stepper`); the walk itself (cache/walk.py) stays a per-layer FFN.

  * A plain dense pass (dense settings, or a K so large the walk is dense, and no INSERT override) runs in the
    dense decoder, prefill and decode alike: a "dense" outcome per layer, untimed.
  * A served step: when the key trace (cache/trace.py) names every layer's entry in advance, the decode step runs
    in the served decoder with those entries' outputs (`plan_step` / `settle_step`), or in the replay decoder,
    without the gate, while the steps repeat earlier ones bit for bit (`settle_replayed_step`).
  * A walked step: else, with nothing a lookup needs between layers, the decode step runs in the walked decoder,
    the top-K walk at every layer; the keys, lookups and stores of the misses follow the call
    (`walk_step_k` / `settle_walked_step`).
Served and walked steps keep only the layers a layer-by-layer walk would have given the same output; the step
goes on layer by layer from the first other one (the model's per-layer graphs, `run_graph_layers`).

The stepper also keeps the walk's place in the key trace: every decode lookup the walk makes is linked after the
one before it (`link`), which is what later names a whole step in advance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

import numpy as np

from larql_desktop.engine.cache.keys import packed_mask_key
from larql_desktop.engine.cache.tiers import CacheEntry, frozen_copy
from larql_desktop.engine.cache.trace import KeyTrace
from larql_desktop.engine.graphs.ffn import PLAIN_DENSE
from larql_desktop.engine.model.transformer import KvCache, ScoredFfnCall, TransformerModel

if TYPE_CHECKING:
    from larql_desktop.engine.cache.walk import WalkFfn


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


def _lookup_of(layer: int, following) -> Hashable:
    """The trace's name of a lookup at `layer` from the link that followed the one before it (key, packed bits)."""
    return (layer, following[0])


class WalkStepper:
    """The Stepper of one walk FFN (its `stepper`): the whole-step protocols and the walk's place in the key trace."""

    def __init__(self, walk: WalkFfn, trace: KeyTrace | None):
        self.walk = walk
        # Which key followed which (shared by the engine's walks): lets a decode step whose every layer will hit
        # be named in advance and run in one call (plan_step / settle_step). None: every step runs layer by layer.
        self.trace = trace
        self._step_start: Hashable | None = None   # the trace's link to this step's layer-0 key (set by plan_step)
        self._previous: tuple | None = None        # (layer, key) of this walk's latest decode lookup
        self._last_step_key: Hashable | None = None   # the last layer's key of the previous step (or of a prefill's last row)
        self.steps_served = 0        # decode steps planned and served whole in one call
        self.steps_resumed = 0       # planned steps in which a guess failed: computed on from that layer
        self.steps_walked = 0        # decode steps computed whole in one call of the walked decoder graph
        self.steps_replayed = 0      # served steps whose every input was its entry's, bit for bit (no gate run)
        # Whether the next planned step is expected to replay an earlier one bit for bit: so from each new prompt
        # until a replay finds an input that differs (the served decoder checks the keys from the scores then).
        self._replays = True

    # -- the model's questions (model/transformer.py Stepper) ----------------------------------------------
    def run_whole(self, model: TransformerModel, ids: np.ndarray, h: np.ndarray, start: int, kv: KvCache
                  ) -> np.ndarray | None:
        if self.runs_plain_dense():
            self.record_dense_pass()
            return PLAIN_DENSE.run_whole(model, ids, h, start, kv)
        if ids.size != 1:
            return None
        step = self.plan_step(int(ids[0]))
        if step is not None:
            return self._run_served(model, h, start, kv, step)
        k = self.walk_step_k()
        if k is not None:
            return self._run_walked(model, h, start, kv, k)
        return None

    @property
    def takes_gate_scores(self) -> bool:
        """The walk starts from the gate scores: the model may hand them over from the layer graph's call
        (`scored_ffn`) rather than have them computed by a call of their own. Not with the cache off: then the
        top-K walk graph computes them itself."""
        walk = self.walk
        return not (walk.settings.dense or walk.full_k or walk.selects_in_graph())

    def takes_gate_scores_for(self, rows: int) -> bool:
        """Prefill takes the layer graph's scores even with the cache off: onnxruntime's TopK costs ~36 us a
        row (56 rows: 2 ms per layer, more than the gate product and the Python selection together), so the
        top-K walk graph runs only for decode (one row: ~10 us)."""
        if self.walk.settings.dense or self.walk.full_k:
            return False
        return rows > 1 or self.takes_gate_scores

    def scored_ffn(self, rows: int) -> ScoredFfnCall | None:
        return self.walk.call_with_scores if self.takes_gate_scores_for(rows) else None

    def _run_served(self, model: TransformerModel, h: np.ndarray, start: int, kv: KvCache, step: ServedStep
                    ) -> np.ndarray:
        """A decode step in one call of the served decoder graph (the replay decoder, without the gate, where the
        plan expects the step to repeat an earlier one bit for bit), with the planned outputs; from the first
        layer whose output turns out not to apply, the step goes on layer by layer."""
        decoder = model.decoder
        if step.replay:
            replayed = decoder.run_replay(h, start, kv, model.rope, step.outputs)
            return self._settled(model, replayed, self.settle_replayed_step(step, replayed), step.outputs[-1:],
                                 start, kv)
        ran = decoder.run_served(h, start, kv, model.rope, step.outputs, step.selections)
        return self._settled(model, ran, self.settle_step(step, ran), step.outputs[-1:], start, kv)

    def _run_walked(self, model: TransformerModel, h: np.ndarray, start: int, kv: KvCache, k: int) -> np.ndarray:
        """A decode step in one call of the walked decoder graph (the top-k walk at every layer); from the first
        layer the walk would not have computed so (a cache hit, a tie at the K-th place), layer by layer."""
        ran = model.decoder.run_walked(h, start, kv, model.rope, k)
        return self._settled(model, ran, self.settle_walked_step(ran), ran.outputs[-1:], start, kv)

    def _settled(self, model: TransformerModel, ran, kept: int, last_output: np.ndarray, start: int, kv: KvCache
                 ) -> np.ndarray:
        """The logits of a decode step run in one decoder call, of which the walk kept the first `kept` layers'
        outputs as its own (`last_output` (1, d): the last layer's, what the head reads beside its residual)."""
        if kept == model.config.n_layers:
            kv.length = start + 1
            # A batch of rows (model/batch.py) ran the head for them all with the call: the same head graph on
            # the same residual and output.
            return ran.logits if ran.logits is not None else model.graphs.run_head(ran.residuals[-1:], last_output)
        # Layers before `kept` had what the walk gives them, so layer `kept`'s attention, input and scores stand;
        # its FFN runs now, and the layers after it run again (rewriting their KV rows).
        i = kept
        scores = None if ran.scores is None else ran.scores[i:i + 1]     # a replay computed none
        f = np.ascontiguousarray(self.walk.call_with_scores(i, ran.inputs[i:i + 1], scores), dtype=np.float32)
        return model.run_graph_layers(ran.residuals[i:i + 1], start, kv, self.walk, self, first=i + 1, f=f)

    def runs_decoder_steps(self) -> bool:
        return self.runs_plain_dense() or self.walk_step_k() is not None

    # -- plain dense passes ----------------------------------------------------------------------------------
    def runs_plain_dense(self) -> bool:
        """Whether a whole pass may run as the plain dense model, all layers in one decoder-graph call: yes under
        dense settings (or a K so large the walk is dense anyway) with no INSERT override on any layer."""
        s = self.walk.settings
        return s.whole_model_graph and (s.dense or self.walk.full_k) and not self.walk.patches.overridden_layers

    def record_dense_pass(self) -> None:
        """A pass ran in the decoder graph: a "dense" outcome per layer, untimed (one call ran them all)."""
        bypass = None if self.walk.settings.dense else "full_k"
        for layer in range(self.walk.n_layers):
            self.walk.record_outcome(layer, "dense", None, bypass=bypass)

    # -- the walk's place in the key trace -------------------------------------------------------------------
    def link(self, layer: int, key, selected: np.ndarray) -> None:
        """Note in the trace that `key`, of the selection mask `selected` (F,) or its packed bits, was looked up
        at `layer` after this walk's previous lookup."""
        if self.trace is None:
            return
        previous: Hashable | None
        if layer == 0:
            previous, self._step_start = self._step_start, None
        else:
            previous = self._previous if self._previous is not None and self._previous[0] == layer - 1 else None
        if previous is not None:
            packed = selected if selected.dtype == np.uint8 else np.packbits(selected, bitorder="little")
            self.trace.link(previous, (key, packed))
        self._previous = (layer, key)
        if layer == self.walk.n_layers - 1:
            self._last_step_key = key

    def after_bypass(self, layer: int, bypass: str, scores: np.ndarray) -> None:
        """A layer ran without a lookup (`bypass`, its base gate scores (T, F)): no link follows it. A step after a
        prefill starts from the prompt's last position, whose key names where the step begins; after a patched
        decode step nothing does."""
        self._previous = None
        if bypass == "prefill":
            self._replays = True
        if layer == self.walk.n_layers - 1:
            self._last_step_key = (self.walk.key_of(scores[-1])[0] if bypass == "prefill" and self.trace is not None
                                   else None)

    def pass_end(self):
        """Where the latest pass ended, for `continue_after` when the context is rolled back to that point (a
        regenerate reusing the prompt's pass)."""
        return self._last_step_key

    def continue_after(self, pass_end) -> None:
        """The next step follows the pass whose `pass_end()` this was, not the latest one."""
        self._last_step_key = pass_end
        self._replays = True

    # -- whole steps of hits (the served decoder graph) ----------------------------------------------------
    def _serves_steps(self) -> bool:
        """Whether a whole step may be served from a plan: a cache to serve from, one entry per key (no guard
        bucket to choose within by the input), no INSERT override anywhere, no hit to verify."""
        walk = self.walk
        s = walk.settings
        return (self.trace is not None and not (s.dense or walk.full_k) and s.cosine_guard is None
                and not s.verify_fraction and not walk.patches.overridden_layers and bool(walk.lookup_tiers()))

    def plan_step(self, token: int) -> ServedStep | None:
        """Every layer's entry for a decode step of `token`, guessed by following the trace from the previous
        step's last key and the token, when each guessed key has an entry in some tier; else None. The step then
        runs in the served decoder graph and what it computed goes to `settle_step`, or where the plan's `replay`
        says so in the replay decoder graph, to `settle_replayed_step`."""
        # Where the previous step ended is unknown (a new walk, a patched pass): no link is made from here, as
        # one from "nowhere" would name the entries of whatever step last began there.
        start = None if self._last_step_key is None else ("step", self._last_step_key, int(token))
        self._step_start = start
        if start is None or not self._serves_steps():
            return None
        assert self.trace is not None          # _serves_steps checked it
        walk = self.walk
        n = walk.n_layers
        chain = self.trace.follow_chain(start, n, _lookup_of)
        namespace = walk.namespace()
        if chain is None or any(key[0] != namespace for key, _ in chain):   # links made under other settings
            return None
        keys = tuple(key for key, _ in chain)
        entries: list = [None] * n
        found_in = [0] * n
        missing = list(range(n))
        for i, tier in enumerate(walk.lookup_tiers()):    # each tier once, for the layers the ones above lack
            for layer, entry in zip(missing, tier.newest_many([(layer, keys[layer]) for layer in missing])):
                if entry is not None:      # its input is checked once the step has run
                    entries[layer], found_in[layer] = entry, i
            missing = [layer for layer in missing if entries[layer] is None]
            if not missing:
                break
        else:
            return None
        packed = tuple(selection for _, selection in chain)
        masks = np.unpackbits(np.stack(packed), axis=1, count=walk.intermediate, bitorder="little")
        return ServedStep(start, keys, packed, masks.view(bool), tuple(entries), tuple(found_in),
                          np.stack([e.output for e in entries]), np.stack([e.residual for e in entries]),
                          self._replays)

    def settle_step(self, step: ServedStep, ran) -> int:
        """Check each layer's guessed entry against the step as it ran (a decoder.ServedPass: each layer's normed
        FFN input, gate scores and whether the guessed selection held): served where its key is the key of the
        layer's scores and the hit rule lets it serve the layer's input (what a lookup would serve), recorded as
        that tier's hit (untimed: one call ran the step) and filling the tiers above it. Stops at the first
        layer where a guess fails and returns how many layers were served: the model computes from there, and
        that layer's lookup is its own."""
        holds = self._keys_hold(step, ran.scores, ran.settled) & self.walk.hit_rule.admits(ran.inputs, step.residuals)
        return self._serve_layers(step, holds)

    def settle_replayed_step(self, step: ServedStep, ran) -> int:
        """As `settle_step` for a step the replay decoder ran (a decoder.ReplayPass, no gate scores): a layer is
        served where its input is, bit for bit, the input its entry was computed from. The same graphs on the
        same input give the same scores, so the key of the layer's scores is the entry's key (under which the
        walk stored it), and the hit rule admits an input at distance 0: what a lookup would serve. At the first
        other layer the model computes on (that layer's lookup makes its own scores), and the next steps run in
        the served decoder, which checks each key from the scores, until the next prompt."""
        same = (ran.inputs.view(np.uint32) == step.residuals.view(np.uint32)).all(axis=1)
        served = self._serve_layers(step, same & self.walk.hit_rule.admits(ran.inputs, step.residuals))
        if served == len(step.keys):
            self.steps_replayed += 1
        else:
            self._replays = False
        return served

    def _serve_layers(self, step: ServedStep, holds: np.ndarray) -> int:
        """The layers of a planned step before the first whose guess does not hold (`holds`, (n_layers,) bool)
        take their guessed entries: counted as hits of the tiers that held them (untimed: one call ran the
        step), linked in the trace, filling the tiers above them. Returns how many."""
        walk = self.walk
        served = len(step.keys) if holds.all() else int(np.argmin(holds))
        tiers = walk.lookup_tiers()
        if served == len(step.keys):
            self.steps_served += 1
        else:
            self.steps_resumed += 1
        if not served:
            return 0
        assert self.trace is not None          # a step is planned only with a trace
        layers = range(served)
        keys = step.keys
        # The links that named these layers, followed again (kept as recent), and where the next step starts.
        self.trace.link_many([(step.start, (keys[0], step.packed[0]))] +
                             [((layer - 1, keys[layer - 1]), (keys[layer], step.packed[layer]))
                              for layer in range(1, served)])
        self._step_start = None
        self._previous = (served - 1, keys[served - 1])
        if served == walk.n_layers:
            self._last_step_key = keys[-1]
        if walk.key_log is not None:
            walk.key_log.extend((layer, keys[layer]) for layer in layers)
        for i, upper in enumerate(tiers[:-1]):       # a hit fills the tiers above it
            fills = [(layer, keys[layer], step.entries[layer]) for layer in layers if step.found_in[layer] > i]
            if fills:
                upper.store_many(fills)
        results = [tuple((t.name, i == found) for i, t in enumerate(tiers[:found + 1])) for found in range(len(tiers))]
        walk.record_untimed([(layer, "hit", results[step.found_in[layer]], None) for layer in layers],
                            tier=tiers[step.found_in[served - 1]].name)
        return served

    def _keys_hold(self, step: ServedStep, scores: np.ndarray, settled: np.ndarray) -> np.ndarray:
        """Per layer, whether the key of its scores is the guessed key. Where the guessed selection is the
        scores' top K with no tie at the K-th place (`settled`, checked in the graph), it is: the key is a
        function of the selection. Elsewhere, and for keys of fewer features than K, the key is made and
        compared."""
        walk = self.walk
        holds = settled.copy() if walk.key_width >= walk.top_k else np.zeros(len(step.keys), bool)
        for layer in np.flatnonzero(~holds):
            holds[layer] = walk.key_of(scores[layer])[0] == step.keys[layer]
            if not holds[layer]:
                break              # the step is served up to here: the layers after it do not matter
        return holds

    # -- whole steps of the walk (the walked decoder graph) -------------------------------------------------
    def walk_step_k(self) -> int | None:
        """Asked when `plan_step` gave None: K when a decode step may run whole in the walked decoder graph (the
        walk, no INSERT override anywhere, and none of the per-layer work a lookup can need before its layer's
        FFN runs or after a miss: a guard's bucket chosen by the input, hits to verify, near-miss explanations);
        None keeps the step layer by layer."""
        walk = self.walk
        s = walk.settings
        if (not s.whole_model_graph or s.dense or walk.full_k or walk.patches.overridden_layers
                or s.cosine_guard is not None or s.verify_fraction or walk.near_miss is not None):
            return None
        return s.top_k

    def settle_walked_step(self, ran) -> int:
        """Take the layers of a step the walked decoder computed (a decoder.WalkedPass) as the walk's own, from the
        first, up to the first whose selection ties at the K-th place (not "settled": the graph's threshold
        selection then holds every tied feature, where the walk's own rule keeps the lower ids). With the cache
        off, that is all it checks: the per-layer path runs the same top-K walk. With tiers, each layer's key is
        made from its selection and looked up in every tier at once; the layers before the first that a lookup
        would serve are the misses they were: recorded (untimed: one call ran the step), linked in the trace and
        stored. Returns how many; the model computes on from that layer, whose lookup is its own."""
        walk = self.walk
        n = walk.n_layers
        tiers = walk.lookup_tiers()
        kept = n if ran.settled.all() else int(np.argmin(ran.settled))
        if not tiers:
            if kept:
                walk.record_untimed([(layer, "bypass", (), "cache_off") for layer in range(kept)], bypass="cache_off")
            self._previous = self._last_step_key = None
            if kept == n:
                self.steps_walked += 1
            return kept
        if not kept:
            return 0
        packed = np.packbits(ran.selections[:kept], axis=1, bitorder="little")
        if walk.key_width >= walk.top_k:
            namespace = walk.namespace()
            keys = [(namespace, packed_mask_key(row)) for row in packed]
        else:
            keys = [walk.key_of(ran.scores[layer])[0] for layer in range(kept)]
        for tier in tiers:          # the first layer some tier would serve ends what the step keeps
            entries = tier.newest_many([(layer, keys[layer]) for layer in range(kept)])
            found = [layer for layer, entry in enumerate(entries) if entry is not None]
            if found:
                admitted = walk.hit_rule.admits(ran.inputs[found], np.stack([entries[i].residual for i in found]))
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
        if walk.key_log is not None:
            walk.key_log.extend((layer, keys[layer]) for layer in layers)
        misses = tuple((tier.name, False) for tier in tiers)
        walk.record_untimed([(layer, "miss", misses, None) for layer in layers])
        return kept
