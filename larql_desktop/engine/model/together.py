"""Passes of several contexts run together, layer by layer: each context's attention in its own layer graph call
(its own KV cache and positions), then one FFN call over the rows of all of them, and one head call at the end.

INSERT runs dozens of short passes over the same layers (a target token after each of ~90 contexts, a trial
write's last position re-run from its layer): one at a time, each layer of each pass is two small graph calls,
and most of their cost is the call. The FFN, the walk's and the dense one alike, computes each row on its own
(the top K and the overlay's overrides are chosen per row), and its graphs give a row the same bits whether it
comes alone or among others (tests/test_together.py), so the rows of many passes go through one call and every
pass computes exactly what it computes alone. The one-token passes (INSERT's extensions by a target token) run
their attention together too, in the row-batched layer graphs, where each row is a sequence of its own and gets
the bits it gets alone. An FFN that looks rows up in a cache (the walk with an L1, L2 or L3) counts and stores
per call: such passes run one at a time, as do passes of the numpy reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from larql_desktop.engine.model.transformer import FfnCall, KvCache, LayerRecord, TransformerModel, stepper_of


class Run(NamedTuple):
    """One context's pass in `forward_together`: `ids` after `kv`'s context, `record` as forward's. With
    `prefix_of`, the index of an earlier run whose context begins with the same `shared` tokens as this one's and
    whose cache already holds them or runs them: this cache takes that one's rows before `shared`, layer by layer
    as they are written (the pass is causal), and `kv` holds `shared` positions when given."""
    ids: Sequence[int]
    kv: KvCache
    record: LayerRecord | None = None
    prefix_of: int | None = None
    shared: int = 0


class Resumed(NamedTuple):
    """One pass in `resume_together`: `h` and `x` are what `record` gave for the layer it resumes from over the
    kv cache's last T positions, as `TransformerModel.resume` takes them."""
    h: np.ndarray
    x: np.ndarray
    kv: KvCache
    record: LayerRecord | None = None


# Fewer one-token passes than this run their attention one call each: the row-batched call's KV copies and
# set-up are not worth it for one.
ROWS_TOGETHER = 2


@dataclass
class _Pass:
    """A pass between two layers: its residual going into the next layer and the FFN output of the one before."""
    h: np.ndarray
    f: np.ndarray
    start: int
    kv: KvCache
    record: LayerRecord | None
    scored: bool            # the layer graph hands the FFN its gate scores, as a lone pass of these rows would
    prefix_of: int | None = None
    shared: int = 0


def runs_together(model: TransformerModel, ffn: FfnCall) -> bool:
    """Whether passes under `ffn` may share its calls: the layer graphs run (not the numpy reference) and the FFN
    looks nothing up per call (a walk without cache tiers, or a plain FFN)."""
    tiers = getattr(ffn, "lookup_tiers", None)
    return model.graphs is not None and not (tiers is not None and tiers())


def forward_together(model: TransformerModel, runs: Sequence[Run], ffn: FfnCall) -> list[np.ndarray]:
    """Each run's last position's logits (vocab,), as `model.forward(run.ids, run.kv, ffn, record=run.record)`
    computes them, with the FFN and head calls shared by all runs."""
    if not runs_together(model, ffn):
        out = []
        for run in runs:
            if run.prefix_of is not None:
                run.kv.copy_prefix(runs[run.prefix_of].kv, run.shared)
            out.append(model.forward(run.ids, run.kv, ffn, record=run.record)[-1])
        return out
    passes: list[_Pass] = []
    for run in runs:
        ids = np.asarray(run.ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("no tokens to run")
        if ids.min() < 0 or ids.max() >= model.config.vocab_size:
            raise ValueError(f"token id out of range for a vocabulary of {model.config.vocab_size}")
        start = run.shared if run.prefix_of is not None else run.kv.length
        if run.prefix_of is not None and not 0 <= run.prefix_of < len(passes):
            raise ValueError("a run's prefix must come from a run before it")
        run.kv.reserve(start + ids.size)
        # Layer 0 has no previous FFN output to add: zeros.
        passes.append(_Pass(model.embed(ids), model.graphs.zeros(ids.size), start, run.kv, run.record,
                            _scored(model, ffn, ids.size), run.prefix_of, run.shared))
    return _run_layers(model, passes, ffn, 0)


def resume_together(model: TransformerModel, layer: int, resumed: Sequence[Resumed], ffn: FfnCall
                    ) -> list[np.ndarray]:
    """Each pass's last position's logits (vocab,), as `model.resume(layer, r.h, r.x, r.kv, ffn, record=r.record)`
    computes them, with the FFN and head calls shared."""
    if not resumed:
        return []
    if not runs_together(model, ffn):
        return [model.resume(layer, r.h, r.x, r.kv, ffn, record=r.record)[-1] for r in resumed]
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer must be within 0..{model.config.n_layers - 1}, not {layer}")
    for r in resumed:
        if r.kv.length < r.h.shape[0]:
            raise ValueError(f"the kv cache holds {r.kv.length} positions, fewer than the {r.h.shape[0]} to resume")
    # `resume` calls the plain FFN at the layer it resumes from, whatever the rows.
    outputs = _split(ffn(layer, np.concatenate([r.x for r in resumed])), [r.h.shape[0] for r in resumed])
    passes = [_Pass(r.h, np.ascontiguousarray(f, dtype=np.float32), r.kv.length - r.h.shape[0], r.kv, r.record,
                    _scored(model, ffn, r.h.shape[0])) for r, f in zip(resumed, outputs)]
    return _run_layers(model, passes, ffn, layer + 1)


def _scored(model: TransformerModel, ffn: FfnCall, rows: int) -> bool:
    """Whether a lone pass of `rows` positions would have its layer graphs hand `ffn` the gate scores."""
    stepper = stepper_of(ffn)
    return model.graphs.has_gate_scores and stepper is not None and stepper.scored_ffn(rows) is not None


def _split(rows: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    return np.split(rows, np.cumsum(sizes)[:-1])


class _OneTokenRows:
    """The one-token passes of a `_run_layers` call, whose attention runs in one row-batched layer graph call per
    layer (OnnxBlocks.run_layer_rows) instead of one call each: each row on a copy of its pass's KV rows of that
    layer, its new key and value written back after (SmolLM2, 40 passes of 20-90 positions: 4.2 ms of calls a
    layer one by one, ~0.9 ms in one call; in an insert's profile the copies take about a third of what is left).
    Each row gets run_layer's bits."""

    def __init__(self, model: TransformerModel, passes: list[_Pass]):
        cfg = model.config
        self.model, self.passes = model, passes
        self.positions = np.array([p.start for p in passes], np.int64)
        capacity = int(self.positions.max()) + 1
        self.keys = np.zeros((len(passes), cfg.n_kv_heads, capacity, cfg.head_dim), np.float32)
        self.values = np.zeros_like(self.keys)
        self.tables = {base: model.rope.table(base, capacity)
                       for base in {cfg.rope_base_for(i) for i in range(cfg.n_layers)}}

    def run(self, layer: int) -> list[np.ndarray]:
        """Layer `layer` for every pass: sets each pass's h, returns each pass's FFN input (1, d)."""
        for b, p in enumerate(self.passes):
            self.keys[b, :, :p.start] = p.kv.keys[layer][:, :p.start]
            self.values[b, :, :p.start] = p.kv.values[layer][:, :p.start]
        cos, sin = self.tables[self.model.config.rope_base_for(layer)]
        h, x = self.model.graphs.run_layer_rows(layer, np.concatenate([p.h for p in self.passes]),
                                                np.concatenate([p.f for p in self.passes]), self.keys, self.values,
                                                self.positions, cos, sin)
        out = []
        for b, p in enumerate(self.passes):
            p.kv.keys[layer][:, p.start] = self.keys[b, :, p.start]
            p.kv.values[layer][:, p.start] = self.values[b, :, p.start]
            p.h = h[b:b + 1]
            out.append(x[b:b + 1])
        return out


def _one_token_rows(model: TransformerModel, passes: list[_Pass]) -> _OneTokenRows | None:
    """The passes `_OneTokenRows` runs together (one token each, no gate scores wanted, no prefix to take from
    another pass), when there are at least ROWS_TOGETHER of them and the graphs can."""
    if not getattr(model.graphs, "runs_rows_together", False):
        return None
    rows = [p for p in passes if p.h.shape[0] == 1 and not p.scored and p.prefix_of is None]
    return _OneTokenRows(model, rows) if len(rows) >= ROWS_TOGETHER else None


def _run_layers(model: TransformerModel, passes: list[_Pass], ffn: FfnCall, first: int) -> list[np.ndarray]:
    """The layers from `first` on for every pass (its attention alone, or with the other one-token passes in one
    call, the FFN for all rows of a kind at once: the passes whose lone run would hand the FFN gate scores, and
    the others), then the head for all."""
    cfg, graphs = model.config, model.graphs
    if not passes:
        return []
    stepper = stepper_of(ffn)
    # The FFN a lone pass of a scored pass's rows would be handed (the same call for any such count of rows).
    scored_call = next((stepper.scored_ffn(p.h.shape[0]) for p in passes if p.scored), None) \
        if stepper is not None else None
    tables = [{base: model.rope.table(base, p.start + p.h.shape[0])
               for base in {cfg.rope_base_for(i) for i in range(cfg.n_layers)}} for p in passes]
    kinds = {scored: [p for p in passes if p.scored == scored] for scored in (False, True)}
    together = _one_token_rows(model, passes)
    rowed = {id(p): k for k, p in enumerate(together.passes)} if together is not None else {}
    for i in range(first, cfg.n_layers):
        inputs: dict[bool, list[np.ndarray]] = {False: [], True: []}
        scores: list[np.ndarray] = []
        rowed_inputs = together.run(i) if together is not None else []
        for p, bases in zip(passes, tables):
            if id(p) in rowed:
                x = rowed_inputs[rowed[id(p)]]
                if p.record is not None:
                    p.record(i, p.h, x)
                inputs[False].append(x)
                continue
            if p.prefix_of is not None:
                p.kv.copy_prefix(passes[p.prefix_of].kv, p.shared, i)
            cos, sin = bases[cfg.rope_base_for(i)]
            ran = graphs.run_layer(i, p.h, p.f, p.kv.keys[i], p.kv.values[i], p.start, cos, sin,
                                   gate_scores=p.scored)
            p.h, x = ran[0], ran[1]
            if p.scored:
                scores.append(ran[2])
            if p.record is not None:
                p.record(i, p.h, x)
            inputs[p.scored].append(x)
        for scored, kind in kinds.items():
            if not kind:
                continue
            rows = np.concatenate(inputs[scored])
            out = scored_call(i, rows, np.concatenate(scores)) if scored and scored_call else ffn(i, rows)
            for p, f in zip(kind, _split(out, [p.h.shape[0] for p in kind])):
                p.f = np.ascontiguousarray(f, dtype=np.float32)
    for p in passes:
        p.kv.length = p.start + p.h.shape[0]
    logits = graphs.run_head(np.concatenate([p.h[-1:] for p in passes]), np.concatenate([p.f[-1:] for p in passes]))
    return list(logits)
