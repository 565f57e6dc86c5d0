"""A quick end-to-end check of an installation or a packaged build: load, generate, hit the cache."""
from __future__ import annotations

from typing import Callable

from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.paths import AppPaths
from larql_desktop.engine.loading import load_model


class SelfTestFailure(ValueError):
    pass


def run_self_test(paths: AppPaths, model_name: str, threads: int = 2, tokens: int = 8,
                  log: Callable[[str], None] = print) -> None:
    model = load_model(model_name, paths, threads=threads)
    log(f"loaded {model.name} in {model.load_seconds:.2f} s ({model.config.n_layers} layers)")
    engine = LarqlEngine(model)
    prompt = "How many legs does a spider have?" if model.is_chat else "The capital of France is"
    settings = SamplingSettings(max_tokens=tokens)
    first_session, second_session = engine.new_session(), engine.new_session()
    first = [s for s in first_session.reply(prompt, settings)]
    second = [s for s in second_session.reply(prompt, settings)]
    text = "".join(s.text for s in first)
    log(f"reply: {text!r}")
    if not first or not text.strip():
        raise SelfTestFailure("the model generated no text")
    if [s.token_id for s in first] != [s.token_id for s in second]:
        raise SelfTestFailure("the same greedy prompt gave different tokens twice")
    snap = engine.session_snapshot(second_session)
    l2_hits = int(snap.tiers["L2"].hits.sum())
    log(f"cache: second run {l2_hits} L2 hits in {snap.lookups} decode lookups")
    if snap.lookups == 0 or l2_hits != snap.lookups:
        raise SelfTestFailure(f"expected every decode lookup of the repeat to hit L2, got {l2_hits}/{snap.lookups}")
