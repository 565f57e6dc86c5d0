"""Where an INSERT feature fires: the regularised Fisher discriminant between the fact's answer positions and
everything it must leave alone (a closed-form solve), the install layers, and the steep step a pair of features
makes of the key's score."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from larql_desktop.engine.model.overlay import PatchOperation
from larql_desktop.engine.patches.insert.phrasings import Fact

RIDGE = 0.05            # Fisher discriminant regulariser, as a share of the mean variance
# ... for the first token's key of a chat model, which must also fire where the question follows earlier turns it
# was not shown: fitted as tightly as the others, the discriminant leaned on what its training conversations share
# beyond the question (SmolLM2, six facts asked after same-relation turns about nine countries none of its
# conversations held: the key fired after 40 of 54 at 0.05, 46 at 0.2, 47 at 0.5 with the worst fact worse). At
# 0.1 rather than 0.2, insert-eval's 17 held-out facts answered 91 of 102 conversations instead of 93, and with
# fifty facts together the real entity's question kept its reply in 125 of 150 instead of 120.
FIRST_TOKEN_RIDGE = 0.1
ANSWER_LEAD_IN = 2      # positions just before a positive's answer that are not negatives (inner_negative_positions)
POSITIVE_SLACK = 0.1    # share of the positives the gate may leave below its threshold (fisher_key)
THRESHOLD_SHARE = 0.4   # the gate's zero between the negatives' top and the positives' bottom
MAX_LAYERS_PER_TOKEN = 3
YIELD_SHARE = 0.25      # of the gap between the negatives' top and the positives' bottom that yielding ones may take
# A solve whose margin is below BOOST_TARGET is solved again (up to BOOST_ROUNDS in all) with the hard negatives
# near or above the positives' low end (within BOOST_BAND of the way down to the negatives' median) weighing BOOST
# times more each round; the best margin of the rounds is kept. At most BOOST ** 5 (243) times more: at 8 a round
# (32,768 times) those few rows were the discriminant, whose direction then scored high where no negative had
# been (SmolLM2, "The sport of Quarston" after "of Quarford": its key wrote " Tam" at the start of replies to
# other relations' questions about a real country after a system prompt or an earlier turn, 7 of 30; at 3, none,
# and both facts still answer their own prompts).
BOOST_ROUNDS = 6
BOOST_TARGET = 0.2
BOOST_BAND = 0.1
BOOST = 3.0
WIN_HEADROOM = 1.25     # strength_to_win: how far a fact's own key outscores another's on its positions
MAX_STRENGTH = 16.0
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
               yielding: np.ndarray | None = None, rounds: int = BOOST_ROUNDS, ridge_share: float = RIDGE
               ) -> tuple[np.ndarray, float, np.ndarray, float]:
    """Gate row, gate bias and up row of a feature that fires on `pos` and not on `neg`, nor on `yielding`
    where the positives' lowest still scores above those.

    The gate direction is the regularised Fisher discriminant w = (S_pos + S_neg + rI)^-1 (mu_pos - mu_neg), r
    `ridge_share` of the mean variance (the larger, the nearer w is to the plain difference of the means);
    the bias puts the gate's zero between the negatives' highest score and the positives' lowest; the gate is
    scaled so the positives' median scores 1 above it. The positives' "lowest" is their POSITIVE_SLACK quantile,
    or the lowest of the first `required` and of the indices `also` (which must fire) when that is lower. The
    up row is 1 on a typical positive (up . mu_pos = 1), so the down vector's scale reads as the write's size.
    Returns also the margin (positives' lowest minus negatives' highest, in units of the positives' median distance to the threshold),
    negative when the two overlap.

    A few hard negatives that read like the positives (an earlier fact's question under the same relation about
    a similar invented name) count for nothing in the means and covariances of thousands of rows, and one of
    them can leave every layer without a margin (SmolLM2: "The mayor of Pelmont is" after Kelmere's insert, no
    layer of 15 tried; the insert then kept no key for the first token). While the margin is below BOOST_TARGET
    the discriminant is solved again (at most `rounds` solves in all) with the negatives the positives' low end
    does not clear weighing BOOST times more each round, and the best solve is kept.

    `yielding` negatives (the fact's questions about invented names; for a later token of the target, at a layer
    that cannot tell them all apart, its first tokens begun as another name) shape the direction as the others
    do, and
    raise the threshold over those of them the positives' lowest outscores, by at most YIELD_SHARE of the gap
    the other negatives leave: held as hard as the rest, they cost conversations their answer (ten facts alone:
    52 -> 42 of 60 conversations answered), where a name with no answer of its own loses little when the key
    fires on it."""
    pos = pos.astype(np.float64)
    # The negatives (thousands of rows) stay single precision, as the FFN inputs are: their second moment is one
    # single-precision product summed into double (a double copy and product of ~6,000 rows cost ~0.5 s a solve
    # here; the ridge dwarfs the difference), the hard rows and the yielding ones apart (no joined copy).
    parts = [np.asarray(neg, np.float32)]
    if yielding is not None and len(yielding):
        parts.append(np.asarray(yielding, np.float32))
    hard_rows = parts[0]
    hard = len(hard_rows)
    # Per-class sums, so a round of reweighting costs a rank-k update of the negatives' second moment, not a
    # pass over thousands of rows.
    mu_p = pos.mean(0)
    cov_p = np.cov(pos, rowvar=False) if len(pos) > 1 else np.zeros((pos.shape[1],) * 2)
    sum_n = sum(part.sum(0, dtype=np.float64) for part in parts)
    moment_n = sum((part.T @ part).astype(np.float64) for part in parts)
    count = sum(len(part) for part in parts)
    weights = np.ones(hard)
    best: tuple | None = None
    for _ in range(max(1, rounds)):
        boosted = np.flatnonzero(weights > 1)
        extra = weights[boosted] - 1.0
        total = count + float(extra.sum())
        rows = hard_rows[boosted].astype(np.float64)
        mu_n = (sum_n + extra @ rows) / total
        cov_n = (moment_n + (rows * extra[:, None]).T @ rows) / total - np.outer(mu_n, mu_n)
        cov = cov_p + cov_n
        ridge = ridge_share * np.trace(cov) / cov.shape[0]
        w = np.linalg.solve(cov + ridge * np.eye(cov.shape[0]), mu_p - mu_n)
        w32 = w.astype(np.float32)
        sn = np.concatenate([part @ w32 for part in parts]).astype(np.float64)
        low, high, threshold, median = _placed(pos @ w, sn, hard, required, also)
        margin = (low - high) / median
        if best is None or margin > best[-1]:
            best = (w, threshold, median, margin)
        if margin >= BOOST_TARGET:
            break
        # The negatives the positives' low end does not clear (typically a few positions: an earlier fact's
        # question under the same relation, "The mayor of Kelmere is" against "... of Pelmont is") weigh more in
        # the next solve; in the class means and covariances of thousands of rows they counted for nothing.
        sn = sn[:hard]
        violating = sn >= low - BOOST_BAND * (low - float(np.median(sn)))
        if not violating.any():
            break
        weights[violating] *= BOOST
    assert best is not None
    w, threshold, median, margin = best
    gate = w / median
    bias = -threshold / median
    up = mu_p / float(mu_p @ mu_p)
    return gate.astype(np.float32), float(bias), up.astype(np.float32), float(margin)


def _placed(sp: np.ndarray, sn: np.ndarray, hard: int, required: int, also: Sequence[int]
            ) -> tuple[float, float, float, float]:
    """For scores `sp` (positives) and `sn` (negatives, the first `hard` of them hard, the rest yielding) along
    a direction: the positives' low end, the negatives' top, the threshold between them, and the positives'
    median distance above the threshold (the unit of fisher_key's gate and margin)."""
    # The positives' low end, not their minimum: one odd generated phrasing (or one the model reads as
    # something else) must not cost the fact every other phrasing; the negatives' top stays a hard limit. The
    # first `required` positives (the canonical prompt, the user's paraphrases) are never left out.
    low = min(float(np.quantile(sp, POSITIVE_SLACK)), float(np.min(sp[:required])) if required else np.inf,
              float(np.min(sp[list(also)])) if len(also) else np.inf)
    high = float(np.max(sn[:hard]))
    below = sn[hard:][sn[hard:] < low]
    if below.size and low > high:
        high = max(high, min(float(below.max()), high + YIELD_SHARE * (low - high)))
    # Overlap: keep the negatives silent; the positives above their top still fire.
    threshold = high + THRESHOLD_SHARE * (low - high) if low > high else high
    median = float(np.median(sp)) - threshold
    if median <= 0:
        median = max(float(np.max(sp)) - threshold, 1e-6)
    return low, high, threshold, median


def step_pair(layer: int, slots: Sequence[int], gate: np.ndarray, bias: float, up: np.ndarray, down: np.ndarray,
              fact: Fact, token: int, token_index: int, strength: float = 1.0) -> tuple[PatchOperation, PatchOperation]:
    """Two features that together write `down` * (up . x) * step(gate . x + bias): the first fires with a steep
    gate (STEEPNESS times the key's), the second one unit later and subtracts, so act(s z) - act(s z - 1) rises
    from 0 to ~1 within 1/s of the key's threshold and stays there. A phrasing the key only just recognises
    then gets the whole write, not a fraction of it, and one it recognises strongly no more than the whole.

    `strength` c scales both gates and biases (act(c s z) - act(c s z - c), c high, within the same 1/s) and
    divides the write by c: the same step and write, with scores c times higher where the overlay compares
    facts whose keys fire at one position (LayerOverrides.holding: the strongest fact keeps its features)."""
    s = STEEPNESS * strength
    steep = (gate * s).astype(np.float32)
    down = (down / strength).astype(np.float32)

    def feature(slot: int, write: np.ndarray, gate_bias: float) -> PatchOperation:
        return PatchOperation("insert", layer, int(slot), steep, up, write, gate_bias, entity=fact.entity,
                              relation=fact.relation, target=fact.target, target_token=token, token_index=token_index)
    return feature(slots[0], down, float(bias * s)), feature(slots[1], -down, float(bias * s - strength))


def strength_to_win(others: np.ndarray, x: np.ndarray, gate: np.ndarray, bias: float) -> float:
    """The `step_pair` strength at which the key (`gate`, `bias`, as fisher_key gives them) outscores, with
    WIN_HEADROOM, on its own fact's answer positions `x` the strongest other fact's feature there (`others`, per
    row, biased scores as the overlay computes them) wherever both fire; 1 where none contests, at most
    MAX_STRENGTH. Without it an earlier fact's key that reaches a later fact's question ("Quarford" on "The sport
    of Quarston is") could outscore the later fact's own key there and silence it."""
    ours = (x @ gate + np.float32(bias)) * STEEPNESS      # the pair's first feature's scores at strength 1
    contested = (ours > 0) & (others > 0)
    if not contested.any():
        return 1.0
    need = float(np.max(others[contested] / ours[contested])) * WIN_HEADROOM
    return float(min(max(1.0, need), MAX_STRENGTH))


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
