"""`larql-desktop insert-eval`: how well INSERT answers where people ask, on a facts file.

For each fact (installed alone, on a clean model), with greedy decoding:
  * canonical: the continuation of the probe starts with the whole target word;
  * paraphrases: the same for each paraphrase (for a base model, its "qa" prompts count as paraphrases);
  * chat: for a chat model, each question through the chat template (default system prompt): the reply
    contains the target;
  * neighbours: greedy continuations identical to the unpatched model's;
  * controls: unrelated prompts, greedy continuations identical to the unpatched model's;
then all facts installed together, one after the other: each fact's canonical prompt and paraphrases must
still answer (facts do not undo each other) and the neighbours and controls stay unchanged.

By default INSERT is given only the fact (entity, relation, target): the paraphrases it trains its keys on
are its own, generated from the relation, so the file's paraphrases measure generalisation.
`use_paraphrases` hands them over too (what a user who types paraphrases into the editor gets).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.formats.jsonfile import read_json
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.loading import chat_prompt_ids
from larql_desktop.engine.patches.insert import Fact
from larql_desktop.engine.model.overlay import PatchOverlay
# What counts as answering: shared with the patch editor's probe table (services.fact_probes).
from larql_desktop.engine.services import contains_word, starts_with_word

Log = Callable[[str], None]

# Unrelated prompts whose greedy continuations must not move under any fact.
DEFAULT_CONTROLS = ("Once upon a time,", "Water boils at a temperature of", "def add(a, b):\n    return",
                    "The first man on the moon was", "My favourite colour is", "Hello! How are you")
CONTINUATION_TOKENS = 8
CHAT_REPLY_TOKENS = 48


@dataclass(frozen=True)
class EvalFact:
    entity: str
    relation: str
    target: str
    probe: str
    paraphrases: tuple[str, ...]
    questions: tuple[str, ...]
    qa: tuple[str, ...]
    neighbours: tuple[str, ...]

    @property
    def fact(self) -> Fact:
        return Fact(self.entity, self.relation, self.target)


def read_facts(path: str | Path) -> tuple[list[EvalFact], tuple[str, ...]]:
    """The facts of a file in the insert_generalization.json format, and its control prompts (the file's
    "controls" list when it has one, else DEFAULT_CONTROLS). A malformed file is refused with the reason."""
    doc = read_json(path, "facts file")
    if not isinstance(doc, dict) or not isinstance(doc.get("facts"), list) or not doc["facts"]:
        raise ValueError(f"{path}: expected an object with a non-empty 'facts' list")
    facts = []
    for i, f in enumerate(doc["facts"]):
        where = f"{path}: fact {i}"
        if not isinstance(f, dict):
            raise ValueError(f"{where}: expected an object")
        for key in ("entity", "relation", "target", "probe"):
            if not isinstance(f.get(key), str) or not f[key].strip():
                raise ValueError(f"{where}: '{key}' must be a non-empty string")
        lists = {}
        for key in ("paraphrases", "questions", "qa", "neighbours"):
            value = f.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ValueError(f"{where}: '{key}' must be a list of non-empty strings")
            lists[key] = tuple(value)
        facts.append(EvalFact(f["entity"], f["relation"], f["target"], f["probe"], **lists))
        facts[-1].fact   # Fact's own checks (lengths)
    controls = doc.get("controls", list(DEFAULT_CONTROLS))
    if not isinstance(controls, list) or not all(isinstance(c, str) and c.strip() for c in controls):
        raise ValueError(f"{path}: 'controls' must be a list of non-empty strings")
    return facts, tuple(controls)


class Decoder:
    """Greedy decoding of plain text and chat prompts under an overlay (no caches: every call is fresh)."""

    def __init__(self, engine: LarqlEngine):
        self.engine = engine
        self.model = engine.model
        self.ins = engine.inserter()

    def greedy(self, ids: list[int], overlay: PatchOverlay, n: int) -> list[int]:
        return self.ins.greedy(ids, overlay, n)

    def text(self, prompt: str, overlay: PatchOverlay, n: int = CONTINUATION_TOKENS) -> tuple[int, ...]:
        return tuple(self.greedy(self.model.tokenizer.encode(prompt), overlay, n))

    def chat(self, question: str, overlay: PatchOverlay, n: int = CHAT_REPLY_TOKENS) -> tuple[int, ...]:
        # The question as a new chat tab sends it (the template's default system prompt).
        return tuple(self.greedy(chat_prompt_ids(self.model, question), overlay, n))

    def decode(self, tokens) -> str:
        return self.model.tokenizer.decode(list(tokens))


@dataclass
class Score:
    passed: int = 0
    total: int = 0

    def add(self, ok: bool) -> None:
        self.passed += int(ok)
        self.total += 1

    def __str__(self) -> str:
        return f"{self.passed}/{self.total}" if self.total else "—"

    @property
    def rate(self) -> float | None:
        return self.passed / self.total if self.total else None


@dataclass
class EvalReport:
    model: str
    ffn: str
    use_paraphrases: bool
    scores: dict = field(default_factory=lambda: {k: Score() for k in ROWS})
    insert_seconds: list = field(default_factory=list)
    details: list = field(default_factory=list)     # per fact: prompts, continuations, pass/fail

    def to_dict(self) -> dict:
        return {"model": self.model, "ffn": self.ffn, "use_paraphrases": self.use_paraphrases,
                "scores": {k: {"passed": s.passed, "total": s.total} for k, s in self.scores.items()},
                "insert_seconds": self.insert_seconds, "details": self.details}


ROWS = ("canonical", "paraphrases", "chat", "neighbours", "controls",
        "together canonical", "together paraphrases", "together neighbours", "together controls")


def _target_tokens(n_target_tokens: int) -> int:
    return n_target_tokens + 3


def run_insert_eval(engine_factory: Callable[[], LarqlEngine], facts: list[EvalFact], controls: tuple[str, ...],
                    use_paraphrases: bool = False, log: Log | None = None) -> EvalReport:
    """engine_factory makes a clean engine (no patches); one per fact alone, one for all together."""
    log = log or (lambda line: None)
    clean_engine = engine_factory()
    dec = Decoder(clean_engine)
    model = clean_engine.model
    clean = PatchOverlay()
    chat = model.is_chat
    report = EvalReport(model.name, "dense" if clean_engine.walk_settings.dense else "walk", use_paraphrases)
    s = report.scores
    control_before = {c: dec.text(c, clean) for c in controls}

    def answer_prompts(f: EvalFact) -> list[str]:
        # A base model is asked the qa prompts as plain text: they count as paraphrases.
        return list(f.paraphrases) + ([] if chat else list(f.qa))

    def n_for(f: EvalFact) -> int:
        return _target_tokens(len(dec.ins.target_tokens(f.target)))

    def install(engine: LarqlEngine, f: EvalFact):
        started = time.perf_counter()
        result = engine.insert(f.fact, paraphrases=f.paraphrases if use_paraphrases else ())
        seconds = time.perf_counter() - started
        report.insert_seconds.append(round(seconds, 2))
        return result, seconds

    neighbour_before = {}
    together = engine_factory()
    for i, f in enumerate(facts):
        engine = engine_factory()
        result, seconds = install(engine, f)
        overlay = engine.patches
        detail = {"entity": f.entity, "relation": f.relation, "target": f.target, "seconds": round(seconds, 2),
                  "installed": result.summary(), "prompts": []}
        n = n_for(f)

        def check(row: str, prompt: str, ok: bool, text: str):
            s[row].add(ok)
            detail["prompts"].append({"row": row, "prompt": prompt, "ok": ok, "output": text})

        cont = dec.decode(dec.text(f.probe, overlay, n))
        check("canonical", f.probe, starts_with_word(cont, f.target), cont)
        for p in answer_prompts(f):
            cont = dec.decode(dec.text(p, overlay, n))
            check("paraphrases", p, starts_with_word(cont, f.target), cont)
        if chat:
            for q in f.questions:
                reply = dec.decode(dec.chat(q, overlay))
                check("chat", q, contains_word(reply, f.target), reply)
        for p in f.neighbours:
            if p not in neighbour_before:
                neighbour_before[p] = dec.text(p, clean)
            after = dec.text(p, overlay)
            check("neighbours", p, after == neighbour_before[p], dec.decode(after))
        for c in controls:
            after = dec.text(c, overlay)
            check("controls", c, after == control_before[c], dec.decode(after))
        report.details.append(detail)
        fact_rows = [p for p in detail["prompts"] if p["row"] in ("canonical", "paraphrases", "chat")]
        log(f"{f.entity} -> {f.target}: {seconds:.1f} s, {result.summary()}; "
            f"{sum(p['ok'] for p in fact_rows)}/{len(fact_rows)} answer")
        install(together, f)
        log(f"  together: {i + 1} fact(s) installed")
    overlay = together.patches
    for f in facts:
        n = n_for(f)
        s["together canonical"].add(starts_with_word(dec.decode(dec.text(f.probe, overlay, n)), f.target))
        for p in answer_prompts(f):
            s["together paraphrases"].add(starts_with_word(dec.decode(dec.text(p, overlay, n)), f.target))
        for p in f.neighbours:
            s["together neighbours"].add(dec.text(p, overlay) == neighbour_before[p])
    for c in controls:
        s["together controls"].add(dec.text(c, overlay) == control_before[c])
    return report


def format_report(report: EvalReport) -> list[str]:
    s = report.scores
    secs = report.insert_seconds
    lines = [f"insert-eval: {report.model}, FFN {report.ffn}, INSERT given "
             f"{'the file' if report.use_paraphrases else 'no'} paraphrases",
             f"{'measure':<24} {'passed':>9}  {'rate':>6}"]
    for row in ROWS:
        rate = s[row].rate
        lines.append(f"{row:<24} {str(s[row]):>9}  {'' if rate is None else f'{100 * rate:5.0f}%':>6}")
    if secs:
        lines.append(f"time per insert: mean {np.mean(secs):.1f} s, max {np.max(secs):.1f} s "
                     f"({len(secs)} inserts)")
    failures = [(d["entity"], p) for d in report.details for p in d["prompts"] if not p["ok"]]
    if failures:
        lines.append("failures:")
        for entity, p in failures:
            lines.append(f"  [{p['row']}] {p['prompt']!r} -> {p['output']!r}")
    return lines


def default_engine_factory(model: LoadedModel, dense: bool = True) -> Callable[[], LarqlEngine]:
    walk = WalkSettings(dense=dense)
    return lambda: LarqlEngine(model, walk=walk)
