"""Training-free fact insertion (LARQL's "COMPOSE" INSERT), following shared/notes/larql-reference.md.

INSERT (entity, relation, target) [AT LAYER n] [ALPHA a]: capture the FFN input of the canonical prompt at the
install layer, claim a free feature slot, write gate/up/down overrides scaled by the layer's reference norms,
orthogonalise against decoys and earlier facts, then balance the down vector until the target's probability
lies in [0.30, 0.95], shrinking it if an earlier fact is pushed below 0.20.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from larql_desktop.engine.cache.walk import WalkFfn, WalkSettings
from larql_desktop.engine.model.transformer import KvCache
from larql_desktop.engine.patches.overlay import BaseFeatureWeights, Patch, PatchOperation, PatchOverlay
from larql_desktop.engine.loading import LoadedModel

DECOY_WORDS = ("France", "Germany", "Japan", "Brazil", "Egypt", "Canada", "India", "Italy", "Spain", "China",
               "Mexico", "Kenya", "Norway", "Peru", "Chile", "Greece", "Turkey", "Poland", "Sweden", "Australia")
# Plain sentences whose every position joins the decoys: they span the directions ordinary text occupies at
# the install layer, so the new feature stays quiet outside its own prompt (LARQL's refine, widened).
GENERIC_SENTENCES = (
    "Once upon a time there was a small village.", "Water boils at one hundred degrees.",
    "The weather today is sunny and warm.", "She opened the door and walked in.",
    "Numbers like 1, 2 and 3 are easy to count.", "def main():\n    return 0",
    "The answer is:\n\nThe first step is to read the question.", "What is the best way to learn a language?",
    "In 1998, the company released its first product.", "The United States has fifty states.",
    "He said that the meeting would start at noon.", "Photosynthesis turns light into chemical energy.",
    "The cat sat on the mat and looked at the bird.", "Please write a short story about a dragon.",
    "import numpy as np\nx = np.zeros(3)", "The largest city in the country is also its capital.",
    "Scientists discovered a new species of frog.", "The recipe needs two eggs, flour and sugar.",
)
GATE_GAIN = 30.0
# The gate fires only where the input's projection on the fact's direction exceeds this share of the
# canonical prompt's own (a bias LARQL lacks; see PatchOperation.gate_bias).
ACTIVATION_THRESHOLD = 0.5
P_LOW, P_HIGH, P_EARLIER_FLOOR = 0.30, 0.95, 0.20
Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class Fact:
    entity: str
    relation: str
    target: str

    def __post_init__(self):
        for name in ("entity", "relation", "target"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"INSERT needs a non-empty {name}")
            if len(value) > 200:
                raise ValueError(f"the {name} is too long ({len(value)} characters; 200 at most)")

    @property
    def relation_words(self) -> str:
        words = self.relation.replace("-", " ").replace("_", " ").split()
        # "capital-of" reads "The capital of X is", not "The capital of of X is".
        if len(words) > 1 and words[-1].lower() == "of":
            words = words[:-1]
        return " ".join(words)

    def prompt_for(self, entity: str) -> str:
        return f"The {self.relation_words} of {entity} is"

    @property
    def canonical_prompt(self) -> str:
        return self.prompt_for(self.entity.strip())


@dataclass(frozen=True)
class InsertResult:
    fact: Fact
    layer: int
    feature: int
    probability: float          # target probability on the canonical prompt after balancing
    rounds: int
    patch: Patch


def default_layer(n_layers: int) -> int:
    """End of the knowledge band [2n/5, 4n/5 - 1] minus one."""
    return (4 * n_layers) // 5 - 2


class Inserter:
    def __init__(self, model: LoadedModel, base: BaseFeatureWeights, walk: WalkSettings = WalkSettings(dense=True)):
        self.model = model
        self.base = base
        self.walk = walk
        self._captured: dict[str, list[np.ndarray]] = {}

    def ffn(self, overlay: PatchOverlay) -> WalkFfn:
        cfg = self.model.config
        return WalkFfn(self.model.ffn, cfg.intermediate, self.model.checksum, self.walk, None, None, (), overlay)

    def encode(self, text: str) -> list[int]:
        return self.model.tokenizer.encode(text)

    def target_token(self, target: str) -> int:
        ids = self.model.tokenizer.encode(" " + target.strip(), add_bos=False)
        if not ids:
            raise ValueError(f"target {target!r} has no tokens")
        return ids[0]

    def last_logits(self, text: str, overlay: PatchOverlay) -> np.ndarray:
        return self.model.transformer.forward(self.encode(text), KvCache(self.model.config), self.ffn(overlay))[-1]

    def probability(self, text: str, token: int, overlay: PatchOverlay) -> float:
        z = self.last_logits(text, overlay).astype(np.float64)
        z -= z.max()
        p = np.exp(z)
        return float(p[token] / p.sum())

    def continuation(self, text: str, overlay: PatchOverlay, n: int = 8) -> tuple[str, list[int]]:
        """Greedy continuation of plain text under the overlay."""
        kv = KvCache(self.model.config)
        ffn = self.ffn(overlay)
        logits = self.model.transformer.forward(self.encode(text), kv, ffn)[-1]
        tokens = []
        for _ in range(n):
            token = int(np.argmax(logits))
            if token in self.model.tokenizer.stop_ids:
                break
            tokens.append(token)
            logits = self.model.transformer.forward([token], kv, ffn)[-1]
        return self.model.tokenizer.decode(tokens), tokens

    def ffn_inputs(self, text: str, layer: int) -> np.ndarray:
        """Normed FFN inputs (T, d) at `layer` for every position, through the unpatched dense model.

        One forward pass records every layer, so trying several install layers re-runs no prompt.
        """
        if text not in self._captured:
            captured = []
            plain = self.ffn(PatchOverlay())

            def recording(i, x):
                captured.append(x.copy())
                return plain.dense(i, x)
            self.model.transformer.forward(self.encode(text), KvCache(self.model.config), recording)
            self._captured[text] = captured
        return self._captured[text][layer]

    def reference_norms(self, layer: int) -> tuple[float, float, float]:
        t = self.model.gguf.tensors
        from larql_desktop.engine.formats.quants import dequantize_rows
        rows = np.arange(100)
        gate = dequantize_rows(t[f"blk.{layer}.ffn_gate.weight"], rows)
        up = dequantize_rows(t[f"blk.{layer}.ffn_up.weight"], rows)
        down = self.base.down_matrix(layer)[:, :100]
        return (float(np.median(np.linalg.norm(gate, axis=1))), float(np.median(np.linalg.norm(up, axis=1))),
                float(np.median(np.linalg.norm(down, axis=0))))

    def free_slot(self, layer: int, claimed: set[int], residuals: np.ndarray) -> int:
        """Deterministic: the unclaimed feature least engaged by ordinary inputs (smallest mean |gate score|
        over the decoy residuals), so giving up its base weights changes least; ties by down-vector norm."""
        scores = self.model.ffn.gate_scores(layer, residuals.astype(np.float32))        # (N, F)
        engagement = np.mean(np.abs(scores), axis=0)
        norms = np.linalg.norm(self.base.down_matrix(layer), axis=0)
        for f in np.lexsort((norms, engagement)):
            if int(f) not in claimed:
                return int(f)
        raise ValueError(f"layer {layer} has no free feature slot left")

    def insert(self, fact: Fact, current: PatchOverlay, layer: int | None = None, alpha: float = 0.1,
               progress: Progress | None = None) -> InsertResult:
        """Install `fact` on top of `current`. Without an explicit layer, LARQL's default layer is tried first,
        then its neighbours in the knowledge band, until the target reaches P_LOW."""
        cfg = self.model.config
        if layer is not None and not 0 <= layer < cfg.n_layers:
            raise ValueError(f"layer must be within 0..{cfg.n_layers - 1}, not {layer}")
        if not np.isfinite(alpha):
            raise ValueError(f"alpha must be a finite number (NaN and infinity are not), not {alpha}")
        if not 0 < alpha <= 100:
            raise ValueError(f"alpha must be in (0, 100], not {alpha}")
        if layer is not None:
            candidates = [layer]
        else:
            # LARQL's layer first; then later layers (closer to the output, where a small model often needs
            # the write), then the two before it.
            home = default_layer(cfg.n_layers)
            candidates = [home, *range(home + 1, cfg.n_layers - 1), home - 1, home - 2]
        best = None
        for i, candidate in enumerate(candidates):
            def step(message, fraction, i=i):
                if progress:
                    progress(message, (i + fraction) / len(candidates))
            result = self._install_at(fact, current, candidate, alpha, step)
            if best is None or result.probability > best.probability:
                best = result
            if result.probability >= P_LOW:
                break
        if progress:
            progress("Inserted", 1.0)
        return best

    def _install_at(self, fact: Fact, current: PatchOverlay, layer: int, alpha: float, step) -> InsertResult:
        step(f"Layer {layer}: capturing the canonical prompt's residual", 0.05)
        token = self.target_token(fact.target)
        embed = self.model.transformer.embed(np.array([token]))[0]          # already scaled by embed_scale
        own = self.ffn_inputs(fact.canonical_prompt, layer)
        r = own[-1]
        step(f"Layer {layer}: capturing decoy residuals", 0.15)
        # Decoys: every position of the same template with other entities, of a few plain sentences, of the
        # canonical prompt before its last token, and the last positions of earlier facts at this layer.
        basis = [own[:-1]]
        basis += [self.ffn_inputs(fact.prompt_for(w), layer) for w in DECOY_WORDS
                  if w.lower() != fact.entity.strip().lower()]
        basis += [self.ffn_inputs(text, layer) for text in GENERIC_SENTENCES]
        earlier = [op for p in current.patches for op in p.operations if op.op == "insert"]
        basis += [self.ffn_inputs(Fact(op.entity, op.relation, op.target).canonical_prompt, layer)[-1:]
                  for op in earlier if op.layer == layer]
        decoys = np.concatenate(basis)
        direction = orthogonalise(r, list(decoys))
        g_ref, u_ref, d_ref = self.reference_norms(layer)
        feature = self.free_slot(layer, current.claimed(layer), decoys)
        gate = unit(direction) * g_ref * GATE_GAIN
        gate_bias = -ACTIVATION_THRESHOLD * float(r @ gate)
        up = unit(direction) * u_ref
        down = unit(embed) * d_ref * alpha

        def overlay_with(down_vec):
            op = PatchOperation("insert", layer, feature, gate.astype(np.float32), up.astype(np.float32),
                                down_vec.astype(np.float32), gate_bias, fact.entity, fact.relation, fact.target)
            patch = Patch((op,), self.model.name, self.model.checksum,
                          description=f"INSERT ({fact.entity}, {fact.relation}, {fact.target}) AT LAYER {layer}")
            return PatchOverlay.build(current.patches + (patch,), self.base), patch

        # Balance. The target probability is far from monotonic in the down vector's scale (a write too strong
        # overshoots into other tokens), so LARQL's x1.6 / x0.7 steps are taken over a whole ladder of scales
        # and the smallest scale that lands in [P_LOW, P_HIGH] wins (least disturbance elsewhere); failing
        # that the smallest above P_HIGH, failing that the most probable.
        scales = [1.6 ** k for k in range(-4, 9)]
        trials = []
        for i, scale in enumerate(scales):
            step(f"Layer {layer}: balancing the down vector ({i + 1}/{len(scales)})", 0.2 + 0.6 * i / len(scales))
            trials.append((scale, self.probability(fact.canonical_prompt, token, overlay_with(down * scale)[0])))
        in_band = [t for t in trials if P_LOW <= t[1] <= P_HIGH]
        above = [t for t in trials if t[1] > P_HIGH]
        scale = (in_band or above or [max(trials, key=lambda t: t[1])])[0][0]
        down = down * scale
        # Cross-fact check: do not let an earlier fact fall below the floor.
        earlier_checks = [(Fact(op.entity, op.relation, op.target), self.target_token(op.target)) for op in earlier]
        for _ in range(8 if earlier_checks else 0):
            overlay, _ = overlay_with(down)
            if all(self.probability(f.canonical_prompt, t, overlay) >= P_EARLIER_FLOOR for f, t in earlier_checks):
                break
            down = down * 0.7
        overlay, patch = overlay_with(down)
        final_p = self.probability(fact.canonical_prompt, token, overlay)
        return InsertResult(fact, layer, feature, final_p, len(trials), patch)


def unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    if n == 0.0:
        raise ValueError("cannot normalise a zero vector")
    return v / n


def orthogonalise(r: np.ndarray, basis: list[np.ndarray], tiny: float = 1e-6) -> np.ndarray:
    """r minus its projection on span(basis) (Gram-Schmidt, tiny vectors dropped); r itself if nothing is left."""
    ortho: list[np.ndarray] = []
    for b in basis:
        v = b.astype(np.float64)
        for q in ortho:
            v = v - (v @ q) * q
        n = np.linalg.norm(v)
        if n > tiny * max(np.linalg.norm(b), 1e-30):
            ortho.append(v / n)
    out = r.astype(np.float64)
    for q in ortho:
        out = out - (out @ q) * q
    if np.linalg.norm(out) < 1e-3 * np.linalg.norm(r):
        return r.astype(np.float32)
    return out.astype(np.float32)
