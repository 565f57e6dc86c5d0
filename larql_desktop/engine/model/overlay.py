"""INSERT overrides: an overlay of per-feature gate/up/down vectors on top of the base weights, and patch files.

The base weights are never modified. A patch is an immutable list of operations; the overlay is rebuilt by
folding the applied patches in order, so removing a patch restores exactly the previous overlay (and outputs).
Each layer's epoch is a content hash of that layer's overrides, and the overlay's epoch one of all of them: the
HTTP API reports it so clients can tell patch states apart. Cache keys need none: the walk never looks up a
feature set an override touches (engine/cache/walk.py).
"""
from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from larql_desktop.engine.formats.jsonfile import read_json
from larql_desktop.engine.formats.quants import dequantize, dequantize_rows

PATCH_VERSION = 1
# A file holding a set of patches (one per fact, say: loaded, they are listed and removed one by one).
PATCH_SET_KIND = "larql-patch-set"
PATCH_SET_VERSION = 1
MAX_PATCHES_PER_SET = 10_000
OPERATIONS = ("insert", "update", "delete")
CLEAN_EPOCH = "clean"


class PatchError(ValueError):
    """A patch that cannot be applied; nothing was changed."""


# The largest magnitude of any patch value (vector element or gate bias), checked after conversion to float32
# (the precision the overlay computes in: 1e300 is finite as a 64-bit float and infinite as a 32-bit one).
# Why 1e6: the FFN input of these models is an RMS-normed vector, so |x| <= sqrt(d) * max|norm weight|, a few
# hundred at most (see api/server.py); with every value within 1e6 a vector of d <= 4096 values has a norm
# <= 6.4e7, so a gate score or up projection stays below ~1e11 and one feature's output below ~1e30, far under
# float32's 3.4e38 even summed over every feature. INSERT writes values under 1e4 (alpha <= 100).
MAX_PATCH_VALUE = 1e6


def encode_vector(v: np.ndarray) -> str:
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(text, length: int, where: str) -> np.ndarray:
    if not isinstance(text, str):
        raise PatchError(f"{where}: expected a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as exc:
        raise PatchError(f"{where}: invalid base64 ({exc})") from exc
    if len(raw) != 4 * length:
        raise PatchError(f"{where}: vector has {len(raw) // 4} values ({len(raw)} bytes), the model needs {length}")
    v = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(v).all():
        raise PatchError(f"{where}: vector contains NaN or infinity")
    largest = float(np.abs(v).max(initial=0.0))
    if largest > MAX_PATCH_VALUE:
        raise PatchError(f"{where}: a value of magnitude {largest:.3g} exceeds the limit of {MAX_PATCH_VALUE:g} "
                         "(the FFN output would overflow float32)")
    return v


def stable_dots(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """x (T, d) against each of `rows` (n, d): (T, n) dot products, each summed on its own in one fixed order, so
    a score gets the same bits whatever rows of x and whatever other overrides come with it (numpy's BLAS product
    sums a lone row otherwise than a block, and a column by the block it falls in): an override's share of the
    FFN is the same for a position alone, in a prompt, or among other passes' rows (model/together.py), and for
    a fact alone or among others at its layer. ~23 ms for 2,048 rows under a hundred overrides."""
    return np.einsum("td,nd->tn", x, rows)


def summed_writes(act: np.ndarray, down: np.ndarray) -> np.ndarray:
    """act (T, n) @ down (n, d): the overrides' writes summed one override after another, in their order, over the
    ones that write somewhere in these rows. A row's sum is then the same bits whatever other rows come with it
    and whatever silent overrides (act exactly 0) sit between: facts installed together write, where one holds
    alone, exactly what that fact writes alone (a BLAS product over 5 overrides rounds otherwise than over 3)."""
    active = np.flatnonzero(act.any(axis=0))
    return np.einsum("tn,nd->td", act[:, active], down[active])


@dataclass(frozen=True)
class PatchOperation:
    op: str                          # insert | update | delete
    layer: int
    feature: int
    gate: np.ndarray | None = None
    up: np.ndarray | None = None
    down: np.ndarray | None = None
    # A gate bias is not in LARQL's format: it lets an inserted feature stay silent (below the activation's
    # knee) unless the input aligns with the fact's own residual, so unrelated prompts are left alone.
    gate_bias: float | None = None
    entity: str = ""
    relation: str = ""
    target: str = ""
    # What an INSERT feature writes: the target token id, and its place among the target's tokens (a
    # multi-token target has one or more features per token, each firing on the context before it).
    target_token: int | None = None
    token_index: int | None = None

    def to_json(self) -> dict:
        doc = {"op": self.op, "layer": self.layer, "feature": self.feature}
        if self.op == "insert":
            doc.update(entity=self.entity, relation=self.relation, target=self.target)
            if self.target_token is not None:
                doc["target_token"] = int(self.target_token)
            if self.token_index is not None:
                doc["token_index"] = int(self.token_index)
        for name in ("gate", "up", "down"):
            v = getattr(self, name)
            if v is not None:
                doc[name] = encode_vector(v)
        if self.gate_bias is not None:
            doc["gate_bias"] = float(self.gate_bias)
        return doc


@dataclass(frozen=True)
class Patch:
    operations: tuple[PatchOperation, ...]
    base_model: str
    base_checksum: str
    description: str = ""
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    name: str = ""

    @cached_property
    def id(self) -> str:
        """Stable name of what the patch does: a hash of its model and operations (not its description, name or
        creation time), so front-ends name a patch by content, never by its position in a list."""
        doc = {"base_checksum": self.base_checksum, "operations": [op.to_json() for op in self.operations]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def layers(self) -> list[int]:
        return sorted({op.layer for op in self.operations})

    @property
    def features(self) -> list[tuple[int, int]]:
        return sorted({(op.layer, op.feature) for op in self.operations})

    def to_json(self) -> dict:
        return {"version": PATCH_VERSION, "base_model": self.base_model, "base_checksum": self.base_checksum,
                "created_at": self.created_at, "description": self.description,
                "operations": [op.to_json() for op in self.operations]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    def named(self, name: str) -> "Patch":
        """This patch under another name (its id, made from its content, stays)."""
        return Patch(self.operations, self.base_model, self.base_checksum, self.description, self.created_at,
                     name=name)


def _optional_index(o: dict, key: str, limit: int | None, where: str) -> int | None:
    value = o.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (limit is not None and value >= limit):
        bound = f"0..{limit - 1}" if limit is not None else "0 or more"
        raise PatchError(f"{where}: {key} {value!r} is out of range {bound}")
    return value


def parse_patch(doc, *, n_layers: int, intermediate: int, hidden: int, checksum: str | None,
                source: str = "patch", vocab: int | None = None) -> Patch:
    """Validate a whole patch document; any problem refuses all of it with a message naming the problem."""
    if not isinstance(doc, dict):
        raise PatchError(f"{source}: expected a JSON object")
    version = doc.get("version")
    if version != PATCH_VERSION:
        raise PatchError(f"{source}: unsupported patch version {version!r} (this app reads version {PATCH_VERSION})")
    base_checksum = doc.get("base_checksum")
    if not isinstance(base_checksum, str) or not base_checksum:
        raise PatchError(f"{source}: missing base_checksum (the GGUF sha256 it was made for)")
    if checksum is not None and base_checksum != checksum:
        raise PatchError(f"{source}: made for another model ({doc.get('base_model', '?')}, checksum "
                         f"{base_checksum[:12]}…), not the loaded one ({checksum[:12]}…)")
    ops_doc = doc.get("operations")
    if not isinstance(ops_doc, list) or not ops_doc:
        raise PatchError(f"{source}: 'operations' must be a non-empty list")
    ops = []
    for i, o in enumerate(ops_doc):
        where = f"{source}: operation {i}"
        if not isinstance(o, dict):
            raise PatchError(f"{where}: expected an object")
        kind = o.get("op")
        if kind not in OPERATIONS:
            raise PatchError(f"{where}: unknown op {kind!r} (expected {', '.join(OPERATIONS)})")
        layer, feature = o.get("layer"), o.get("feature")
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers:
            raise PatchError(f"{where}: layer {layer!r} is out of range 0..{n_layers - 1}")
        if not isinstance(feature, int) or isinstance(feature, bool) or not 0 <= feature < intermediate:
            raise PatchError(f"{where}: feature {feature!r} is out of range 0..{intermediate - 1}")
        vectors = {name: decode_vector(o[name], hidden, f"{where} {name}") if name in o else None
                   for name in ("gate", "up", "down")}
        bias = o.get("gate_bias")
        if bias is not None:
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise PatchError(f"{where}: gate_bias must be a finite number, not {bias!r}")
            try:
                with np.errstate(over="ignore"):
                    bias32 = np.float32(bias)
            except OverflowError:        # an integer beyond any float
                bias32 = np.float32(np.inf)
            if not np.isfinite(bias32):
                raise PatchError(f"{where}: gate_bias must be a finite 32-bit float, not {bias!r}")
            if abs(float(bias32)) > MAX_PATCH_VALUE:
                raise PatchError(f"{where}: gate_bias {bias!r} exceeds the limit of {MAX_PATCH_VALUE:g} in "
                                 "magnitude (the FFN output would overflow float32)")
        if kind == "insert" and any(v is None for v in vectors.values()):
            raise PatchError(f"{where}: an insert needs gate, up and down vectors")
        if kind == "update" and all(v is None for v in vectors.values()) and bias is None:
            raise PatchError(f"{where}: an update needs at least one of gate, up, down, gate_bias")
        if kind == "delete" and (any(v is not None for v in vectors.values()) or bias is not None):
            raise PatchError(f"{where}: a delete carries no vectors")
        texts = {k: o.get(k, "") for k in ("entity", "relation", "target")}
        if not all(isinstance(v, str) for v in texts.values()):
            raise PatchError(f"{where}: entity, relation and target must be strings")
        token = _optional_index(o, "target_token", vocab, where)
        index = _optional_index(o, "token_index", None, where)
        if kind != "insert" and (token is not None or index is not None):
            raise PatchError(f"{where}: only an insert names a target token")
        ops.append(PatchOperation(kind, layer, feature, **vectors, gate_bias=None if bias is None else float(bias),
                                  **texts, target_token=token, token_index=index))
    return Patch(tuple(ops), str(doc.get("base_model", "")), base_checksum, str(doc.get("description", "")),
                 str(doc.get("created_at", "")))


def patch_set_json(patches: Iterable[Patch]) -> dict:
    """One document for a set of patches, each kept whole with its name (`parse_patches` reads it back)."""
    return {"kind": PATCH_SET_KIND, "version": PATCH_SET_VERSION,
            "patches": [{"name": p.name, "patch": p.to_json()} for p in patches]}


def save_patch_set(patches: Iterable[Patch], path: str | Path) -> None:
    Path(path).write_text(json.dumps(patch_set_json(patches), indent=1))


def parse_patches(doc, *, source: str = "patch", default_name: str = "", **model_shape) -> tuple[Patch, ...]:
    """The patches of a document: a patch set's, in order, or a single patch. Any problem in any of them refuses
    the whole document with a message naming the patch and the problem. A patch without a name is called
    `default_name` (numbered in a set)."""
    if not (isinstance(doc, dict) and doc.get("kind") == PATCH_SET_KIND):
        return (parse_patch(doc, source=source, **model_shape).named(default_name),)
    version = doc.get("version")
    if version != PATCH_SET_VERSION:
        raise PatchError(f"{source}: unsupported patch set version {version!r} (this app reads version "
                         f"{PATCH_SET_VERSION})")
    entries = doc.get("patches")
    if not isinstance(entries, list) or not entries:
        raise PatchError(f"{source}: 'patches' must be a non-empty list")
    if len(entries) > MAX_PATCHES_PER_SET:
        raise PatchError(f"{source}: {len(entries)} patches are more than a set may hold ({MAX_PATCHES_PER_SET})")
    patches: list[Patch] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries, start=1):
        where = f"{source}: patch {i}"
        if not isinstance(entry, dict):
            raise PatchError(f"{where}: expected an object with 'name' and 'patch'")
        name = entry.get("name", "")
        if not isinstance(name, str):
            raise PatchError(f"{where}: 'name' must be a string")
        patch = parse_patch(entry.get("patch"), source=where, **model_shape)
        if patch.id in seen:
            raise PatchError(f"{where}: the same patch as patch {seen[patch.id]}")
        seen[patch.id] = i
        patches.append(patch.named(name or (f"{default_name} {i}" if default_name else "")))
    return tuple(patches)


def load_patches(path: str | Path, **model_shape) -> tuple[Patch, ...]:
    """The patches of a patch file or patch set file (see parse_patches)."""
    path = Path(path)
    return parse_patches(read_json(path, "patch file", PatchError), source=str(path), default_name=path.stem,
                         **model_shape)


# ----------------------------------------------------------------------------------------------- overlay
@dataclass(frozen=True)
class LayerOverrides:
    """Effective vectors of the overridden features of one layer (gaps filled from the base weights)."""
    features: np.ndarray   # (n,) int
    gate: np.ndarray       # (n, d)
    up: np.ndarray         # (n, d)
    down: np.ndarray       # (n, d)  the feature's column of W_down
    gate_bias: np.ndarray  # (n,)
    gated: np.ndarray      # (n,) bool: inserted features (with a gate bias) take their slot only where they fire
    epoch: str
    group: np.ndarray      # (n,) int: the fact each gated feature writes (fact_groups), -1 for a plain override

    def __post_init__(self):
        for a in (self.features, self.gate, self.up, self.down, self.gate_bias, self.gated, self.group):
            a.flags.writeable = False

    def scores(self, x: np.ndarray) -> np.ndarray:
        """The overrides' biased gate scores (T, n) for normed FFN inputs `x` (T, d): what `holding` reads."""
        return stable_dots(x, self.gate) + self.gate_bias

    def inserted_holding(self, x: np.ndarray) -> np.ndarray:
        """Where each inserted (gated) feature takes its slot (T, n) bool for inputs `x`; plain overrides, which
        hold everywhere, are False (they are no key that fires)."""
        return self.holding(self.scores(x)) & self.gated

    def holding(self, patched: np.ndarray) -> np.ndarray:
        """Where each override takes its slot (T, n) bool, given its biased gate scores `patched` (T, n).

        A plain override (no bias) holds everywhere. An inserted (gated) feature holds where its biased score is
        positive (elsewhere its slot keeps the base feature, so unrelated inputs compute exactly what the base
        model computes), and only if its fact wins there: where the keys of several facts fire at one position,
        the fact whose strongest feature scores highest keeps its features and the others stay silent. Each key
        is scaled so its own fact's typical question scores the same above its threshold (keys.fisher_key), so
        the scores compare; a key that reaches past its own fact (an earlier fact's key never saw a later
        fact's questions) fires weaker there than that fact's own key and gives way, instead of writing its
        target over the other's."""
        fires = (patched > 0.0) & self.gated
        groups = int(self.group.max(initial=-1)) + 1
        if groups > 1 and fires.any():
            strength = np.where(fires, patched, -np.inf)
            best = np.stack([strength[:, self.group == g].max(axis=1) for g in range(groups)], axis=1)  # (T, G)
            fires &= self.group[None, :] == np.argmax(best, axis=1)[:, None]
        return fires | ~self.gated


class BaseFeatureWeights:
    """Gate/up rows and down columns of single features, dequantised on demand from the GGUF."""

    def __init__(self, gguf):
        self.gguf = gguf
        self._down: dict[int, np.ndarray] = {}

    def vectors(self, layer: int, feature: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t = self.gguf.tensors
        gate = dequantize_rows(t[f"blk.{layer}.ffn_gate.weight"], np.array([feature]))[0]
        up = dequantize_rows(t[f"blk.{layer}.ffn_up.weight"], np.array([feature]))[0]
        if layer not in self._down:
            self._down[layer] = dequantize(t[f"blk.{layer}.ffn_down.weight"])   # (d, F)
        return gate, up, self._down[layer][:, feature].copy()

    def down_matrix(self, layer: int) -> np.ndarray:
        self.vectors(layer, 0)
        return self._down[layer]


def fact_groups(facts: list[tuple], gated: np.ndarray) -> np.ndarray:
    """(n,) int: per override, the index of its fact among the layer's gated overrides (first seen first), -1 for
    a plain override. A fact is an INSERT's (entity, relation, target), so every feature one INSERT installs (its
    tokens, its step pairs, and trial writes during the insert) is one group; an operation that names no fact
    is a group of its patch alone."""
    ids: dict[tuple, int] = {}
    return np.array([ids.setdefault(fact, len(ids)) if g else -1 for fact, g in zip(facts, gated)], np.int64)


class PatchOverlay:
    """Immutable overlay built from a stack of patches. What the walk FFN consults per layer."""

    def __init__(self, layers: Mapping[int, LayerOverrides] | None = None, patches: tuple[Patch, ...] = ()):
        self._layers = dict(layers or {})
        self.patches = patches
        digest = hashlib.sha256()
        for layer in sorted(self._layers):
            digest.update(f"{layer}:{self._layers[layer].epoch};".encode())
        self.epoch = digest.hexdigest()[:16] if self._layers else CLEAN_EPOCH

    @classmethod
    def build(cls, patches: Iterable[Patch], base: BaseFeatureWeights) -> "PatchOverlay":
        patches = tuple(patches)
        state: dict[tuple[int, int], list] = {}
        facts: dict[tuple[int, int], tuple] = {}     # the fact each slot's last operation writes (fact_groups)
        for index, patch in enumerate(patches):
            for op in patch.operations:
                key = (op.layer, op.feature)
                if op.op == "delete":
                    state.pop(key, None)
                    continue
                facts[key] = ((op.entity.strip().lower(), op.relation.strip().lower(), op.target.strip().lower())
                              if op.entity or op.relation or op.target else ("", "", "", index))
                current = state.get(key) or [*base.vectors(op.layer, op.feature), None]
                new = (op.gate, op.up, op.down, op.gate_bias)
                state[key] = [v if v is not None else old for v, old in zip(new, current)]
        by_layer: dict[int, list] = {}
        for (layer, feature), vecs in sorted(state.items()):
            by_layer.setdefault(layer, []).append((feature, vecs))
        layers = {}
        for layer, items in by_layer.items():
            features = np.array([f for f, _ in items], np.int64)
            gate, up, down = (np.stack([v[i] for _, v in items]).astype(np.float32) for i in range(3))
            gated = np.array([v[3] is not None for _, v in items])
            bias = np.array([v[3] or 0.0 for _, v in items], np.float32)
            group = fact_groups([facts[(layer, f)] for f, _ in items], gated)
            h = hashlib.sha256(features.tobytes())
            for a in (gate, up, down, bias):
                h.update(np.ascontiguousarray(a, "<f4").tobytes())
            h.update(gated.tobytes())
            h.update(group.astype("<i8").tobytes())
            layers[layer] = LayerOverrides(features, gate, up, down, bias, gated, h.hexdigest()[:16], group)
        return cls(layers, patches)

    def has_overrides_at(self, layer: int) -> bool:
        return layer in self._layers

    def layer(self, layer: int) -> LayerOverrides | None:
        return self._layers.get(layer)

    def layer_epoch(self, layer: int) -> str:
        lo = self._layers.get(layer)
        return lo.epoch if lo is not None else CLEAN_EPOCH

    @property
    def overridden_layers(self) -> list[int]:
        return sorted(self._layers)

    def claimed(self, layer: int) -> set[int]:
        lo = self._layers.get(layer)
        return set(lo.features.tolist()) if lo is not None else set()
