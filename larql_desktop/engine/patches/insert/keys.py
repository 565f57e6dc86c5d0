"""Where an INSERT feature fires: the regularised Fisher discriminant between the fact's answer positions and
everything it must leave alone (a closed-form solve), the install layers, and the steep step a pair of features
makes of the key's score."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from larql_desktop.engine.model.overlay import PatchOperation
from larql_desktop.engine.patches.insert.phrasings import Fact

RIDGE = 0.05            # Fisher discriminant regulariser, as a share of the mean variance
ANSWER_LEAD_IN = 2      # positions just before a positive's answer that are not negatives (inner_negative_positions)
POSITIVE_SLACK = 0.1    # share of the positives the gate may leave below its threshold (fisher_key)
THRESHOLD_SHARE = 0.4   # the gate's zero between the negatives' top and the positives' bottom
MAX_LAYERS_PER_TOKEN = 3
YIELD_SHARE = 0.25      # of the gap between the negatives' top and the positives' bottom that yielding ones may take
STEEPNESS = 10.0        # of a feature pair's step (step_pair): full write from 0.1 of the median positive's score


def default_layer(n_layers: int) -> int:
    """End of the knowledge band [2n/5, 4n/5 - 1] minus one (LARQL's install layer)."""
    return (4 * n_layers) // 5 - 2


def key_layers(n_layers: int, bounded_writes: bool) -> list[int]:
    """Candidate install layers, best first. Without post-FFN norms: just past LARQL's layer, then outwards
    through the late half (the answer position has gathered the entity; the write reaches the output through
    few layers). With them (Gemma), one layer's write is bounded by its norm and, being dominant there,
    displaces that layer's own output: the last layers first, where nothing downstream needs it."""
    if bounded_writes:
        return list(range(n_layers - 1, n_layers // 2 - 1, -1))
    home = default_layer(n_layers)
    start = min(home + 2, n_layers - 2)
    order = [start]
    for step in range(1, n_layers):
        for layer in (start - step, start + step):
            if n_layers // 2 <= layer < n_layers - 1 and layer not in order:
                order.append(layer)
    return order


def fisher_key(pos: np.ndarray, neg: np.ndarray, required: int = 1, also: Sequence[int] = (),
               yielding: np.ndarray | None = None) -> tuple[np.ndarray, float, np.ndarray, float]:
    """Gate row, gate bias and up row of a feature that fires on `pos` and not on `neg`, nor on `yielding`
    where the positives' lowest still scores above those.

    The gate direction is the regularised Fisher discriminant w = (S_pos + S_neg + rI)^-1 (mu_pos - mu_neg);
    the bias puts the gate's zero between the negatives' highest score and the positives' lowest; the gate is
    scaled so the positives' median scores 1 above it. The positives' "lowest" is their POSITIVE_SLACK quantile,
    or the lowest of the first `required` and of the indices `also` (which must fire) when that is lower. The
    up row is 1 on a typical positive (up . mu_pos = 1), so the down vector's scale reads as the write's size.
    Returns also the margin (positives' lowest minus negatives' highest, in units of the positives' median distance to the threshold),
    negative when the two overlap.

    `yielding` negatives (the fact's questions about invented names) shape the direction as the others do, and
    raise the threshold over those of them the positives' lowest outscores, by at most YIELD_SHARE of the gap
    the other negatives leave: held as hard as the rest, they cost conversations their answer (ten facts alone:
    52 -> 42 of 60 conversations answered), where a name with no answer of its own loses little when the key
    fires on it."""
    pos = pos.astype(np.float64)
    neg = neg.astype(np.float64)
    hard = len(neg)
    if yielding is not None and len(yielding):
        neg = np.concatenate([neg, yielding.astype(np.float64)])
    mu_p, mu_n = pos.mean(0), neg.mean(0)
    cov = np.cov(pos, rowvar=False) if len(pos) > 1 else np.zeros((pos.shape[1],) * 2)
    cov = cov + np.cov(neg, rowvar=False)
    ridge = RIDGE * np.trace(cov) / cov.shape[0]
    w = np.linalg.solve(cov + ridge * np.eye(cov.shape[0]), mu_p - mu_n)
    sp, sn = pos @ w, neg @ w
    # The positives' low end, not their minimum: one odd generated phrasing (or one the model reads as
    # something else) must not cost the fact every other phrasing; the negatives' top stays a hard limit. The
    # first `required` positives (the canonical prompt, the user's paraphrases) are never left out.
    low = min(float(np.quantile(sp, POSITIVE_SLACK)), float(np.min(sp[:required])) if required else np.inf,
              float(np.min(sp[list(also)])) if len(also) else np.inf)
    high = float(np.max(sn[:hard]))
    below = sn[hard:][sn[hard:] < low]
    if below.size and low > high:
        high = max(high, min(float(below.max()), high + YIELD_SHARE * (low - high)))
    if low > high:
        threshold = high + THRESHOLD_SHARE * (low - high)
    else:
        # Overlap: keep the negatives silent; the positives above their top still fire.
        threshold = high
    median = float(np.median(sp)) - threshold
    if median <= 0:
        median = max(float(np.max(sp)) - threshold, 1e-6)
    gate = w / median
    bias = -threshold / median
    up = mu_p / float(mu_p @ mu_p)
    margin = (low - high) / median
    return gate.astype(np.float32), float(bias), up.astype(np.float32), float(margin)


def step_pair(layer: int, slots: Sequence[int], gate: np.ndarray, bias: float, up: np.ndarray, down: np.ndarray,
              fact: Fact, token: int, token_index: int) -> tuple[PatchOperation, PatchOperation]:
    """Two features that together write `down` * (up . x) * step(gate . x + bias): the first fires with a steep
    gate (STEEPNESS times the key's), the second one unit later and subtracts, so act(s z) - act(s z - 1) rises
    from 0 to ~1 within 1/s of the key's threshold and stays there. A phrasing the key only just recognises
    then gets the whole write, not a fraction of it, and one it recognises strongly no more than the whole."""
    s = STEEPNESS
    steep = (gate * s).astype(np.float32)
    down = down.astype(np.float32)
    def feature(slot: int, write: np.ndarray, gate_bias: float) -> PatchOperation:
        return PatchOperation("insert", layer, int(slot), steep, up, write, gate_bias, entity=fact.entity,
                              relation=fact.relation, target=fact.target, target_token=token, token_index=token_index)
    return feature(slots[0], down, float(bias * s)), feature(slots[1], -down, float(bias * s - 1.0))


def inner_negative_positions(contexts: list[tuple[int, ...]], answered: int = 0) -> list[np.ndarray]:
    """Per context, the positions before its last that are negatives: all but those where another context
    (a positive) ends, e.g. the "is" of "The capital of X is called" is the answer position of "... X is",
    and the phrasing's last words before its answer. The contexts end in the `answered` target tokens already
    inserted: the positions before each of them are negatives (each wants its own token, not this step's)."""
    ends = set(contexts)

    def negative(c: tuple[int, ...], t: int) -> bool:
        question_end = len(c) - 1 - answered     # the phrasing's answer position
        # "The capital of X is known as" asks for the answer as much as "... as the" does, and one such
        # position among the negatives sets the gate's threshold for all.
        return c[:t + 1] not in ends and not question_end - ANSWER_LEAD_IN <= t < question_end
    return [np.array([t for t in range(len(c) - 1) if negative(c, t)], np.int64) for c in contexts]
