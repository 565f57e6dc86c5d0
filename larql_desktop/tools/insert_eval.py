"""`larql-desktop insert-eval`: how well INSERT answers where people ask, on a facts file.

For each fact (installed alone, on a clean model), with greedy decoding:
  * canonical: the continuation of the probe starts with the whole target word;
  * paraphrases: the same for each paraphrase (for a base model, its "qa" prompts count as paraphrases);
  * chat: for a chat model, each question through the chat template (default system prompt): the reply
    contains the target (and, with facts installed together, no other fact's target that the conversation does
    not name: 50 facts together once put another fact's target into 171 of their 500 chat, conversation and keep
    replies, 70 of which named their own target too and had counted as answers);
  * conversation: for a chat model, the question asked after earlier turns (the same relation about a real
    entity, another relation, small talk) or under a user's own system prompt: the reply contains the whole
    target. The cases are generated from the relation (earlier assistant turns are the unpatched model's own
    replies) and read from the facts file's "cases" (the insert_conversations.json format);
  * conversation keep: in the same conversations, the question about a real entity: the reply is the
    unpatched model's, token for token (and contains the file's "answer" when it gives one);
  * neighbours: greedy continuations identical to the unpatched model's;
  * controls: unrelated prompts, greedy continuations identical to the unpatched model's;
then all facts installed together, one after the other, and every row measured again ("together ..."), and one
fact's patch removed: its prompts must give the unpatched model's outputs again ("removed: back to base") and
the others' must not move ("removed: others kept"). `together` = N skips the one-at-a-time pass and installs the
first N facts together (the many-facts measure).

By default INSERT is given only the fact (entity, relation, target): the paraphrases it trains its keys on
are its own, generated from the relation, so the file's paraphrases measure generalisation.
`use_paraphrases` hands them over too (what a user who types paraphrases into the editor gets).
Every prompt's row (what was asked, the output, pass or fail) is in the report's details (`--json`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.formats.jsonfile import read_json
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.loading import conversation
from larql_desktop.engine.patches.insert import Fact, fill
from larql_desktop.engine.patches.insert.capture_store import CaptureStore
from larql_desktop.engine.model.overlay import PatchOverlay
# What counts as answering: shared with the patch editor's probe table (services.fact_probes).
from larql_desktop.engine.services import contains_word, starts_with_word

Log = Callable[[str], None]

# Unrelated prompts whose greedy continuations must not move under any fact.
DEFAULT_CONTROLS = ("Once upon a time,", "Water boils at a temperature of", "def add(a, b):\n    return",
                    "The first man on the moon was", "My favourite colour is", "Hello! How are you")
CONTINUATION_TOKENS = 8
CHAT_REPLY_TOKENS = 48
HISTORY_REPLY_TOKENS = 32     # an earlier assistant turn: the unpatched model's reply, cut after its first sentence
# Generated conversations. Real entities INSERT's own negatives do not use (insert.DECOY_ENTITIES), so the
# conversation rows measure what the method was not shown.
REAL_ENTITIES = ("Spain", "Mexico", "Sweden", "Australia", "Greece")
OTHER_RELATIONS = ("population", "largest city", "official language")
SMALL_TALK = ("Write a two-line rhyme about the moon.", "What is 15 plus 27?", "Why is the sky blue? One sentence.")
KEEP_EVERY = 2       # keep questions are asked after every second case (each one a whole reply, twice)
SYSTEM_PROMPTS = ("You are a geography teacher. Answer briefly.", "You are a helpful assistant. Reply in one sentence.")


@dataclass(frozen=True)
class ConversationCase:
    """A conversation that ends with a question: the turns before it as (role, content) pairs, a system prompt
    (None: the template's default, as a new chat tab has it). An assistant turn of None is the unpatched model's
    own reply to the turn before (generated cases). `kind` names what comes before the question."""
    kind: str
    history: tuple[tuple[str, str | None], ...]
    ask: str
    system: str | None = None


@dataclass(frozen=True)
class KeepQuestion:
    """A question about something real whose reply must not change; `answer`, when given, must be in it."""
    ask: str
    answer: str = ""


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
    cases: tuple[ConversationCase, ...] = ()
    keep: tuple[KeepQuestion, ...] = ()

    @property
    def fact(self) -> Fact:
        return Fact(self.entity, self.relation, self.target)


def generated_cases(fact: Fact) -> tuple[tuple[ConversationCase, ...], tuple[KeepQuestion, ...]]:
    """Conversations about the fact generated from its relation: earlier turns about real entities under the
    same relation and another one, small talk, a user's system prompt (alone and with an earlier turn). The
    keep questions ask the relation of another real entity (asked after each case's turns)."""
    r, e = fact.relation_words, fact.entity.strip()
    other = next(o for o in OTHER_RELATIONS if o != r.lower())

    def turn(question: str) -> tuple[tuple[str, str | None], ...]:
        return (("user", question), ("assistant", None))
    ask = fill("What is the {r} of {e}?", r, e)
    cases = (
        ConversationCase("same relation", turn(fill("What is the {r} of {e}?", r, REAL_ENTITIES[0])), ask),
        ConversationCase("same relation, follow-up", turn(fill("What is the {r} of {e}?", r, REAL_ENTITIES[1])),
                         fill("And what about {e}? What is its {r}?", r, e)),
        ConversationCase("other relation", turn(fill("What is the {r} of {e}?", other, REAL_ENTITIES[2])),
                         fill("Tell me the {r} of {e}.", r, e)),
        ConversationCase("small talk", turn(SMALL_TALK[0]) + turn(SMALL_TALK[1]), ask),
        ConversationCase("system prompt", (), ask, SYSTEM_PROMPTS[0]),
        ConversationCase("system prompt, same relation", turn(fill("What is the {r} of {e}?", r, REAL_ENTITIES[3])),
                         ask, SYSTEM_PROMPTS[1]),
    )
    return cases, (KeepQuestion(fill("What is the {r} of {e}?", r, REAL_ENTITIES[4])),)


def _strings(value, where: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{where}: '{key}' must be a list of non-empty strings")
    return tuple(value)


def _read_cases(f: dict, where: str) -> tuple[tuple[ConversationCase, ...], tuple[KeepQuestion, ...]]:
    cases = []
    for j, c in enumerate(f.get("cases", [])):
        at = f"{where}: case {j}"
        if not isinstance(c, dict) or not isinstance(c.get("ask"), str) or not c["ask"].strip():
            raise ValueError(f"{at}: expected an object with a non-empty 'ask'")
        system = c.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"{at}: 'system' must be a string")
        history = c.get("history", [])
        if not isinstance(history, list) or not all(
                isinstance(h, list) and len(h) == 2 and h[0] in ("user", "assistant") and isinstance(h[1], str)
                for h in history):
            raise ValueError(f"{at}: 'history' must be a list of [role, content] pairs (role user or assistant)")
        cases.append(ConversationCase("file", tuple((role, text) for role, text in history), c["ask"], system))
    if not isinstance(f.get("cases", []), list):
        raise ValueError(f"{where}: 'cases' must be a list")
    keep = []
    for j, k in enumerate(f.get("keep", [])):
        if not isinstance(k, dict) or not isinstance(k.get("ask"), str) or not k["ask"].strip() \
                or not isinstance(k.get("answer", ""), str):
            raise ValueError(f"{where}: keep {j}: expected an object with a non-empty 'ask' (and an 'answer')")
        keep.append(KeepQuestion(k["ask"], k.get("answer", "")))
    return tuple(cases), tuple(keep)


def read_facts(path: str | Path, generate_conversations: bool = True) -> tuple[list[EvalFact], tuple[str, ...]]:
    """The facts of a file in the insert_generalization.json format (or insert_conversations.json's: a fact's
    "probe" defaults to its canonical prompt, its "cases" and "keep" are conversations), and its control prompts
    (the file's "controls" list when it has one, else DEFAULT_CONTROLS). With `generate_conversations`, every
    fact also gets the cases generated from its relation. A malformed file is refused with the reason."""
    doc = read_json(path, "facts file")
    if not isinstance(doc, dict) or not isinstance(doc.get("facts"), list) or not doc["facts"]:
        raise ValueError(f"{path}: expected an object with a non-empty 'facts' list")
    facts = []
    for i, f in enumerate(doc["facts"]):
        where = f"{path}: fact {i}"
        if not isinstance(f, dict):
            raise ValueError(f"{where}: expected an object")
        for key in ("entity", "relation", "target", "probe"):
            if key == "probe" and "probe" not in f:
                continue
            if not isinstance(f.get(key), str) or not f[key].strip():
                raise ValueError(f"{where}: '{key}' must be a non-empty string")
        lists = {key: _strings(f.get(key, []), where, key) for key in ("paraphrases", "questions", "qa", "neighbours")}
        cases, keep = _read_cases(f, where)
        fact = Fact(f["entity"], f["relation"], f["target"])      # Fact's own checks (lengths)
        if generate_conversations:
            more_cases, more_keep = generated_cases(fact)
            cases, keep = cases + more_cases, keep + more_keep
        facts.append(EvalFact(f["entity"], f["relation"], f["target"], f.get("probe", fact.canonical_prompt),
                              **lists, cases=cases, keep=keep))
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
        self._own_replies: dict[tuple, str] = {}

    def greedy(self, ids: list[int], overlay: PatchOverlay, n: int) -> list[int]:
        return self.ins.greedy(ids, overlay, n)

    def text(self, prompt: str, overlay: PatchOverlay, n: int = CONTINUATION_TOKENS) -> tuple[int, ...]:
        return tuple(self.greedy(self.model.tokenizer.encode(prompt), overlay, n))

    @staticmethod
    def chat_case(question: str) -> ConversationCase:
        """The question as a new chat tab sends it (the template's default system prompt)."""
        return ConversationCase("chat", (), question)

    def chat(self, question: str, overlay: PatchOverlay, n: int = CHAT_REPLY_TOKENS) -> tuple[int, ...]:
        return self.conversation(self.chat_case(question), overlay, n)

    def said(self, case: ConversationCase) -> str:
        """Every word of the conversation before the reply: its system prompt, turns and question."""
        return " ".join([case.system or ""] + [m["content"] for m in self.messages(case)])

    def messages(self, case: ConversationCase, ask: str | None = None) -> list[dict]:
        """The case's turns with its own (or another) question last; an assistant turn of None becomes the
        unpatched model's reply, its first sentence (remembered: every fact's cases share a few)."""
        messages = []
        for role, content in case.history:
            if content is None:
                key = (case.system, tuple((m["role"], m["content"]) for m in messages))
                if key not in self._own_replies:
                    ids = self.model.encode_prompt(conversation(self.model, messages, case.system))
                    reply = self.decode(self.greedy(ids, PatchOverlay(), HISTORY_REPLY_TOKENS)).strip()
                    cut = min((reply.find(m) + 1 for m in (". ", ".\n") if m in reply), default=len(reply))
                    self._own_replies[key] = reply[:cut].strip() or "I see."
                content = self._own_replies[key]
            messages.append({"role": role, "content": content})
        return messages + [{"role": "user", "content": case.ask if ask is None else ask}]

    def conversation(self, case: ConversationCase, overlay: PatchOverlay, n: int = CHAT_REPLY_TOKENS,
                     ask: str | None = None) -> tuple[int, ...]:
        ids = self.model.encode_prompt(conversation(self.model, self.messages(case, ask), case.system))
        return tuple(self.greedy(ids, overlay, n))

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


FACT_ROWS = ("canonical", "paraphrases", "chat", "conversation", "conversation keep", "neighbours")
ROWS = (FACT_ROWS + ("controls",) + tuple(f"together {r}" for r in FACT_ROWS)
        + ("together controls", "removed: back to base", "removed: as before its insert", "removed: others kept"))


@dataclass
class EvalReport:
    model: str
    ffn: str
    use_paraphrases: bool
    scores: dict = field(default_factory=lambda: {k: Score() for k in ROWS})
    insert_seconds: list = field(default_factory=list)
    details: list = field(default_factory=list)     # per fact (and pass): prompts, outputs, pass/fail
    together: int = 0                               # facts installed together

    def to_dict(self) -> dict:
        return {"model": self.model, "ffn": self.ffn, "use_paraphrases": self.use_paraphrases,
                "together": self.together,
                "scores": {k: {"passed": s.passed, "total": s.total} for k, s in self.scores.items()},
                "insert_seconds": self.insert_seconds, "details": self.details}


def _target_tokens(n_target_tokens: int) -> int:
    return n_target_tokens + 3


class FactMeasure:
    """Every row of one fact under one overlay, each prompt's output kept (for --json and for the removal check)."""

    def __init__(self, dec: Decoder, clean_outputs: dict, chat: bool):
        self.dec = dec
        self.clean_outputs = clean_outputs     # (kind, prompt) -> tokens under no patches, shared
        self.chat = chat

    def clean(self, key: tuple, run: Callable[[PatchOverlay], tuple[int, ...]]) -> tuple[int, ...]:
        if key not in self.clean_outputs:
            self.clean_outputs[key] = run(PatchOverlay())
        return self.clean_outputs[key]

    def outputs(self, f: EvalFact, overlay: PatchOverlay) -> list[tuple[str, str, tuple, Callable]]:
        """(row, prompt, key, run) of every prompt of the fact; run(overlay) gives its output tokens."""
        dec = self.dec
        n = _target_tokens(len(dec.ins.target_tokens(f.target)))
        rows = [("canonical", f.probe, ("text", f.probe, n), lambda o, p=f.probe: dec.text(p, o, n))]
        for p in list(f.paraphrases) + ([] if self.chat else list(f.qa)):
            rows.append(("paraphrases", p, ("text", p, n), lambda o, p=p: dec.text(p, o, n)))
        if self.chat:
            for q in f.questions:
                rows.append(("chat", q, ("chat", q), lambda o, q=q: dec.chat(q, o)))
            for i, case in enumerate(f.cases):
                rows.append(("conversation", case, ("case", case),
                             lambda o, c=case: dec.conversation(c, o)))
                for k in f.keep if i % KEEP_EVERY == 0 else ():
                    rows.append(("conversation keep", (case, k), ("case", case, k.ask),
                                 lambda o, c=case, a=k.ask: dec.conversation(c, o, ask=a)))
        for p in f.neighbours:
            rows.append(("neighbours", p, ("text", p, CONTINUATION_TOKENS), lambda o, p=p: dec.text(p, o)))
        return rows

    def restored_outputs(self, f: EvalFact, overlay: PatchOverlay) -> list[tuple[str, str, tuple, Callable]]:
        """`outputs` of the prompts a removal of f's patch must restore: all but its neighbours'."""
        return [output for output in self.outputs(f, overlay) if output[0] != "neighbours"]

    def measure(self, f: EvalFact, overlay: PatchOverlay, scores: dict, prefix: str = "",
                others: Sequence[str] = ()) -> list[dict]:
        """Every row of `f` under `overlay`, counted in `scores` under `prefix` + row; a chat or conversation reply
        that names one of the `others` (the other installed facts' targets) where its conversation does not,
        fails."""
        dec = self.dec
        out = []
        for row, prompt, key, run in self.outputs(f, overlay):
            tokens = run(overlay)
            text = dec.decode(tokens)
            if row in ("canonical", "paraphrases"):
                ok = starts_with_word(text, f.target)
            elif row in ("chat", "conversation"):
                asked = dec.said(prompt if isinstance(prompt, ConversationCase) else dec.chat_case(prompt))
                ok = contains_word(text, f.target) and not any(
                    contains_word(text, other) and not contains_word(asked, other) for other in others
                    if other.strip().lower() != f.target.strip().lower())
            else:        # neighbours, conversation keep: the unpatched model's output, token for token
                ok = tokens == self.clean(key, run)
                if row == "conversation keep" and prompt[1].answer:
                    ok = ok and contains_word(text, prompt[1].answer)
            scores[prefix + row].add(ok)
            out.append({"row": prefix + row, **self.describe(prompt), "ok": ok, "output": text,
                        "tokens": list(tokens)})
        return out

    def describe(self, prompt) -> dict:
        if isinstance(prompt, str):
            return {"prompt": prompt}
        case, keep = (prompt, None) if isinstance(prompt, ConversationCase) else prompt
        doc = {"prompt": case.ask if keep is None else keep.ask, "kind": case.kind,
               "history": [[m["role"], m["content"]] for m in self.dec.messages(case)[:-1]]}
        if case.system is not None:
            doc["system"] = case.system
        return doc


def run_insert_eval(engine_factory: Callable[[], LarqlEngine], facts: list[EvalFact], controls: tuple[str, ...],
                    use_paraphrases: bool = False, log: Log | None = None,
                    together: int | None = None, alone_only: bool = False) -> EvalReport:
    """engine_factory makes a clean engine (no patches); one per fact alone, one for all together. With
    `together`, only the first `together` facts, installed together (no one-at-a-time pass); with `alone_only`,
    only the one-at-a-time pass."""
    log = log or (lambda line: None)
    if together is not None:
        if together < 1:
            raise ValueError(f"--together must be at least 1, not {together}")
        if alone_only:
            raise ValueError("--together and --alone exclude each other")
        facts = facts[:together]
    clean_engine = engine_factory()
    dec = Decoder(clean_engine)
    model = clean_engine.model
    clean = PatchOverlay()
    report = EvalReport(model.name, "dense" if clean_engine.walk_settings.dense else "walk", use_paraphrases,
                        together=len(facts))
    s = report.scores
    measure = FactMeasure(dec, {}, model.is_chat)
    control_before = {c: dec.text(c, clean) for c in controls}

    def install(engine: LarqlEngine, f: EvalFact):
        started = time.perf_counter()
        result = engine.insert(f.fact, paraphrases=f.paraphrases if use_paraphrases else ())
        seconds = time.perf_counter() - started
        report.insert_seconds.append(round(seconds, 2))
        return result, seconds

    def measure_controls(overlay: PatchOverlay, prefix: str) -> list[dict]:
        rows = []
        for c in controls:
            after = dec.text(c, overlay)
            ok = after == control_before[c]
            s[prefix + "controls"].add(ok)
            rows.append({"row": prefix + "controls", "prompt": c, "ok": ok, "output": dec.decode(after)})
        return rows

    engine_together = engine_factory()
    gone = len(facts) // 2          # the fact whose patch is removed after the together pass
    before_insert: list[tuple[int, ...]] = []    # its prompts' outputs just before it was installed
    for i, f in enumerate(facts):
        if not alone_only and i == gone:
            before_insert = [run(engine_together.patches) for _, _, _, run
                             in measure.restored_outputs(f, engine_together.patches)]
        if together is None:
            engine = engine_factory()
            result, seconds = install(engine, f)
            detail = {"pass": "alone", "entity": f.entity, "relation": f.relation, "target": f.target,
                      "seconds": round(seconds, 2), "installed": result.summary(),
                      "prompts": measure.measure(f, engine.patches, s) + measure_controls(engine.patches, "")}
            report.details.append(detail)
            rows = [p for p in detail["prompts"] if p["row"] in ("canonical", "paraphrases", "chat", "conversation")]
            log(f"{f.entity} -> {f.target}: {seconds:.1f} s, {result.summary()}; "
                f"{sum(p['ok'] for p in rows)}/{len(rows)} answer")
        if alone_only:
            continue
        result, seconds = install(engine_together, f)
        log(f"  together: {i + 1} fact(s) installed ({f.entity} -> {f.target}: {seconds:.1f} s, "
            f"{result.summary()})")
    if alone_only:
        return report
    overlay = engine_together.patches
    kept_outputs = {}
    for f in facts:
        prompts = measure.measure(f, overlay, s, "together ", others=[g.target for g in facts if g is not f])
        kept_outputs[f.entity] = prompts
        report.details.append({"pass": "together", "entity": f.entity, "relation": f.relation, "target": f.target,
                               "prompts": prompts})
    report.details.append({"pass": "together", "entity": "", "prompts": measure_controls(overlay, "together ")})
    log(f"together: {len(facts)} fact(s) measured")
    # One fact's patch removed (the middle one): its prompts are the unpatched model's again ("back to base"),
    # unless an earlier fact's key fires on them; they are what they were just before the fact was installed
    # ("as before its insert": an earlier key that fired there before fires there again, a later key must not);
    # and the others' do not move.
    if len(facts) >= 1:
        patch = overlay.patches[gone]
        engine_together.remove_patch(patch.id)
        rest = engine_together.patches
        removed_rows = []
        for (_, prompt, key, run), before in zip(measure.restored_outputs(facts[gone], rest), before_insert):
            tokens = run(rest)
            for name, expected in (("removed: back to base", measure.clean(key, run)),
                                   ("removed: as before its insert", before)):
                ok = tokens == expected
                s[name].add(ok)
                removed_rows.append({"row": name, **measure.describe(prompt), "ok": ok,
                                     "output": dec.decode(tokens)})
        for j, f in enumerate(facts):
            if j == gone:
                continue
            for (row, prompt, key, run), before in zip(measure.outputs(f, rest), kept_outputs[f.entity]):
                if row not in ("canonical", "paraphrases"):
                    continue           # the cheap rows: a removal that moved any would move these
                tokens = run(rest)
                ok = list(tokens) == before["tokens"]
                s["removed: others kept"].add(ok)
                removed_rows.append({"row": "removed: others kept", **measure.describe(prompt), "ok": ok,
                                     "output": dec.decode(tokens)})
        report.details.append({"pass": "removed", "entity": facts[gone].entity, "prompts": removed_rows})
    return report


def format_report(report: EvalReport) -> list[str]:
    s = report.scores
    secs = report.insert_seconds
    lines = [f"insert-eval: {report.model}, FFN {report.ffn}, INSERT given "
             f"{'the file' if report.use_paraphrases else 'no'} paraphrases",
             f"{'measure':<32} {'passed':>9}  {'rate':>6}"]
    for row in ROWS:
        rate = s[row].rate
        lines.append(f"{row:<32} {str(s[row]):>9}  {'' if rate is None else f'{100 * rate:5.0f}%':>6}")
    if secs:
        lines.append(f"time per insert: mean {np.mean(secs):.1f} s, max {np.max(secs):.1f} s "
                     f"({len(secs)} inserts)")
    failures = [(d["entity"], p) for d in report.details for p in d["prompts"] if not p["ok"]]
    if failures:
        lines.append("failures:")
        for entity, p in failures:
            where = f" ({p['kind']}{', system prompt' if 'system' in p else ''})" if "kind" in p else ""
            lines.append(f"  [{p['row']}{where}] {p['prompt']!r} -> {p['output']!r}")
    return lines


def default_engine_factory(model: LoadedModel, dense: bool = True, capture_store: CaptureStore | None = None
                           ) -> Callable[[], LarqlEngine]:
    """A new engine per call (`--alone`: nothing an earlier insert captured is remembered in memory); with
    `capture_store`, the negatives' captures kept on disk are read, as the app reads them after a restart."""
    walk = WalkSettings(dense=dense)
    return lambda: LarqlEngine(model, walk=walk, capture_store=capture_store)
