"""Training-free fact insertion: INSERT (entity, relation, target) so the model answers where people ask.

LARQL's COMPOSE insert (shared/notes/larql-reference.md) keys one feature on one sentence and writes the target's
first token. Here, per target token (each firing on the context that precedes it):

  * keys: the normed FFN inputs at the answer position of many phrasings of the question (the user's
    paraphrases, ones generated from the relation, Q/A forms and, for chat models, the chat template with the
    assistant starting its answer, also after earlier turns and under system prompts, where the reply's first
    position must fire) are the positives; every position of the same phrasings about other entities, of the
    same entity under other relations, of plain text, of earlier facts, of the model's own continuations of
    some of them, of the same conversations asking about real entities, and the non-answer positions of the
    positives themselves are the negatives. The gate is the regularised Fisher discriminant
    between the two (a closed-form solve) with a bias at the middle of the margin, so the feature fires on the
    fact's meaning rather than on one sentence and stays silent elsewhere (where the overlay then computes
    exactly what the base model computes);
  * values: the direction that raises the target token's logit against the model's current candidates,
    through the final norm and the unembedding (and, on models with a post-FFN norm, through that norm),
    scaled by a search over real forward passes until the target wins on the positives; written by a pair of
    features whose difference is a steep, saturating step of the key's score (`step_pair`), so a phrasing the
    key only just recognises gets the whole write and a strongly recognised one no more;
  * several layers when one is not enough (a post-FFN norm bounds what one layer can write);
  * one more step after the last target token, for the word's end: where the model would go on with the word
    ("Ottoline" -> "Ottolineus") or start it over ("Eldwin Eldwin", the first token's key firing again just
    after the word), a feature writes a comma, full stop or line break there;
  * the phrasings include, for relations people insert often, frames that ask without naming the relation
    ("In X, people pay with the"; relation_frames.py), and a key may leave its oddest tenth of phrasings
    below its threshold rather than give up the layer;
  * if the canonical prompt still fails (writes from several layers adding up to an overshoot), every write
    is scaled, or a token's last layer or the word-end step dropped, until it answers (rescue_canonical).
Captures are resumed from the changed layer, and there from the first position a new feature fires at (and
extended by the next target token) instead of re-run whole; contexts that share a prefix (the chat template's
turns, a question bare and with its answer begun) run it once; the model's own answers and continuations that
the contexts are made of are decoded together, in the batched decoder graph.

The package by seam: `phrasings` (the fact's question in its many forms, the contexts it must leave alone),
`capture` (forward passes and their captures), `capture_store` (the base passes kept on disk between launches),
`keys` (where a feature fires), `values` (what it writes and how strongly), `inserter` (the steps of one insert).

Everything is forward passes and linear algebra: no gradient descent over the model's weights.
"""
from __future__ import annotations

from larql_desktop.engine.patches.insert.capture import (Cancel, Captured, InsertCancelled, softmax)
from larql_desktop.engine.patches.insert.inserter import (InsertResult, InstalledFeature, Inserter, Progress)
from larql_desktop.engine.patches.insert.keys import (default_layer, fisher_key, inner_negative_positions, key_layers,
                                                      step_pair)
from larql_desktop.engine.patches.insert.phrasings import (ANSWER_STARTS, DECOY_ENTITIES, PHRASINGS, QUESTIONS, Fact,
                                                           fill, generated_phrasings)
from larql_desktop.engine.patches.insert.values import lead, lead_of_word_end, spread, top_tokens, unit

__all__ = ["ANSWER_STARTS", "Cancel", "Captured", "DECOY_ENTITIES", "Fact", "InsertCancelled", "InsertResult",
           "Inserter", "InstalledFeature", "PHRASINGS", "Progress", "QUESTIONS", "default_layer", "fill",
           "fisher_key", "generated_phrasings", "inner_negative_positions", "key_layers", "lead", "lead_of_word_end",
           "softmax", "spread", "step_pair", "top_tokens", "unit"]
