"""Messages between the GUI thread and the engine worker: immutable requests in, immutable answers out.

Plain dataclasses without Qt, so they can be built and tested anywhere. Every request carries the `request_id` the
client gave it and a `label` that names it to the user; every answer and every ErrorReport names the request it
answers by that id (panels route by id, never by wording). The engine's own result types travel inside the answers
(ProbeOutcome, the engine's PatchesChanged, FeatureView, CollapseReport, FrontierPoint): no twins. Each answer type
has its own signal on `EngineClient` (ANSWERS lists them); the worker's handlers, the labs' included, sit in one
table (`EngineWorker`, qt/engine_jobs.py, qt/lab_jobs.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from larql_desktop.engine.analysis.collapse import CollapseReport
from larql_desktop.engine.analysis.features import FeatureView
from larql_desktop.engine.analysis.lens import LogitLens, PromotedTokens
from larql_desktop.engine.cache.stats import StatsSnapshot
from larql_desktop.engine.core import CacheSettings, PatchesChanged
from larql_desktop.engine.model.generation import Alternative, SamplingSettings, TokenStep
from larql_desktop.engine.model.outcomes import LayerOutcome
from larql_desktop.engine.model.prefix_cache import PrefixCacheStats
from larql_desktop.engine.services import FactProbe, ProbeOutcome
from larql_desktop.tools.measure import FrontierPoint
from larql_desktop.qt.reply_stats import ReplyStats


# --- requests (GUI -> worker) ---

@dataclass(frozen=True)
class LoadModel:
    label: ClassVar[str] = "Loading a model"
    request_id: int
    name_or_path: str   # a packaged model's key or a path to a GGUF file
    threads: int


@dataclass(frozen=True)
class SendPrompt:
    label: ClassVar[str] = "Reply"
    request_id: int
    session_id: int
    text: str
    settings: SamplingSettings
    # Set from the GUI thread, read by the worker between tokens: a queued "stop" signal would wait
    # behind the generation loop it is meant to interrupt. One per request, so a Stop can never leak
    # into the next reply.
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass(frozen=True)
class Regenerate:
    label: ClassVar[str] = "Reply"
    request_id: int
    session_id: int
    settings: SamplingSettings
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass(frozen=True)
class OpenChat:
    """A saved chat opened in the window: its conversation becomes the session's, once, and from then on the
    session holds it (the window never sends it again; a model change carries it over)."""
    label: ClassVar[str] = "Opening a chat"
    request_id: int
    session_id: int
    messages: tuple[tuple[str, str], ...]   # (role, content), user and assistant turns
    system_prompt: str | None = None        # None: the chat template's default


@dataclass(frozen=True)
class SetSystemPrompt:
    label: ClassVar[str] = "System prompt"
    request_id: int
    session_id: int
    system_prompt: str | None


@dataclass(frozen=True)
class CloseSession:
    label: ClassVar[str] = "Closing a chat"
    request_id: int
    session_id: int


@dataclass(frozen=True)
class ConfigureCache:
    label: ClassVar[str] = "Cache settings"
    request_id: int
    settings: CacheSettings


@dataclass(frozen=True)
class ClearCaches:
    label: ClassVar[str] = "Clearing caches"
    request_id: int
    persistent: bool = False  # True: the persistent L3 store as well as L1 and L2


@dataclass(frozen=True)
class ResetStats:
    label: ClassVar[str] = "Resetting statistics"
    request_id: int


@dataclass(frozen=True)
class RequestStats:
    """Ask for a stats snapshot now (e.g. the user switched chats), with `session_id` as the active chat."""
    label: ClassVar[str] = "Statistics"
    request_id: int
    session_id: int | None


@dataclass(frozen=True)
class InsertFact:
    label: ClassVar[str] = "INSERT"
    request_id: int
    entity: str
    relation: str
    target: str
    layer: int | None         # None: the engine picks (LARQL's default layer, then its neighbours)
    alpha: float
    probe: str                # a prompt to compare before/after once the fact is in ("" for none)
    paraphrases: tuple[str, ...] = ()   # other phrasings of the question to key on (none: generated ones)
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass(frozen=True)
class ProbeFact:
    """Probe a fact where people ask it (its prompt, paraphrases, a chat question), before and after patches."""
    label: ClassVar[str] = "Probe fact"
    request_id: int
    entity: str
    relation: str
    target: str
    paraphrases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProbePrompt:
    label: ClassVar[str] = "Probe"
    request_id: int
    prompt: str
    target: str               # whose probability to report ("" for none)


@dataclass(frozen=True)
class LoadPatchFile:
    label: ClassVar[str] = "Loading patch file"
    request_id: int
    path: Path


@dataclass(frozen=True)
class SavePatch:
    label: ClassVar[str] = "Saving patch"
    request_id: int
    patch_id: str             # PatchSummary.id: patches are named by content, never by list position
    path: Path


@dataclass(frozen=True)
class SavePatchSet:
    label: ClassVar[str] = "Saving patches"
    request_id: int
    path: Path                # every applied patch, in order, in one patch set file


@dataclass(frozen=True)
class RemovePatch:
    label: ClassVar[str] = "Removing patch"
    request_id: int
    patch_id: str


@dataclass(frozen=True)
class StartServer:
    """Serve the loaded model's engine over HTTP on loopback (0: any free port); follows model changes."""
    label: ClassVar[str] = "HTTP API"
    request_id: int
    port: int


@dataclass(frozen=True)
class StopServer:
    label: ClassVar[str] = "HTTP API"
    request_id: int


# --- snapshots (worker -> GUI) ---

@dataclass(frozen=True)
class ModelInfo:
    request_id: int
    key: str                  # packaged key, or the GGUF file's stem
    packaged: bool            # one of PACKAGED_MODELS (else a GGUF file the user opened)
    display_name: str
    path: Path
    is_chat: bool
    architecture: str
    n_layers: int
    hidden: int
    vocab_size: int
    context_limit: int
    load_seconds: float
    threads: int
    intermediate: int = 0     # FFN features per layer (the largest K)
    default_system_prompt: str | None = None   # what the chat template writes when a chat sets none


@dataclass(frozen=True)
class ReplyStarted:
    request_id: int
    session_id: int
    prompt: str | None        # the user's text; None when regenerating the last reply


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    session_id: int
    token_id: int
    text: str
    index: int
    seconds: float
    prompt_tokens: int
    is_stop: bool
    alternatives: tuple[Alternative, ...] = ()   # the model's top tokens at this step
    layers: tuple[LayerOutcome, ...] = ()        # the FFN per layer in the pass this token was sampled from
    # Where in the session's token history that pass ran (its last position; -1 unknown): the feature view
    # recomputes the pass from history[:position + 1].
    position: int = -1

    @classmethod
    def from_step(cls, request_id: int, session_id: int, step: TokenStep, position: int = -1) -> "TokenEvent":
        return cls(request_id, session_id, step.token_id, step.text, step.index, step.seconds,
                   step.prompt_tokens, step.is_stop, step.alternatives, step.layers, position)


@dataclass(frozen=True)
class ReplyFinished:
    request_id: int
    session_id: int
    text: str                 # the whole reply as the session stored it (includes any held-back UTF-8 tail)
    stats: ReplyStats


@dataclass(frozen=True)
class ErrorReport:
    request_id: int | None
    session_id: int | None
    context: str              # what failed, for the user (the request's label, e.g. "Reply"): never routed on
    message: str

    def describe(self) -> str:
        return f"{self.context}: {self.message}"


@dataclass(frozen=True)
class CacheStatsEvent:
    """Cache statistics for the whole process and for the active chat, with what the charts need beside them."""
    engine_id: int            # changes when a model (re)load builds a new engine: histories restart
    time: float               # time.monotonic() when taken (the clock of StatsSnapshot.recent)
    session_id: int | None
    process: StatsSnapshot
    session: StatsSnapshot | None
    patched_layers: tuple[int, ...]
    settings: CacheSettings
    n_layers: int
    l3_status: dict | None = None   # L3Store.status() (backend, where, errors…); None: no L3 store attached
    prefix_cache: PrefixCacheStats | None = None   # the engine's KV prefix cache (shared prompts' attention KV)


@dataclass(frozen=True)
class PatchesShown:
    """The applied patches after a change by anyone (this window or an HTTP client), as the engine announced it;
    `request_id` is the window's request that made the change, 0 for changes made elsewhere."""
    request_id: int
    change: PatchesChanged    # the engine's event (version: an older one never replaces a newer one)


@dataclass(frozen=True)
class EngineActivity:
    """Something outside the window (an HTTP client) moved the engine's statistics."""
    version: int


@dataclass(frozen=True)
class ServerState:
    """Where the HTTP API answers (None: not serving) and why it does not, if it failed to start."""
    request_id: int
    url: str | None
    error: str = ""


@dataclass(frozen=True)
class InsertProgress:
    request_id: int
    message: str
    fraction: float


@dataclass(frozen=True)
class InsertCancelled:
    """The user stopped an INSERT: nothing was applied."""
    request_id: int


@dataclass(frozen=True)
class InsertFinished:
    request_id: int
    layer: int
    feature: int
    probability: float        # the target's probability on the fact's own prompt
    description: str


@dataclass(frozen=True)
class ProbeAnswered:
    request_id: int
    outcome: ProbeOutcome     # services.probe: the continuation and probability without and with the patches


@dataclass(frozen=True)
class FactProbed:
    """A fact's probe table (services.fact_probes): one row per prompt, without and with the applied patches."""
    request_id: int
    entity: str
    relation: str
    target: str
    rows: tuple[FactProbe, ...]


@dataclass(frozen=True)
class PatchSaved:
    request_id: int
    path: Path
    count: int = 1            # patches written (a patch set file holds several)


# --- the labs: the reply's pictures, the feature view, the collapse lab, the frontier (qt/lab_jobs.py) ---

@dataclass(frozen=True)
class AnalyseReply:
    label: ClassVar[str] = "Reply map"
    request_id: int
    session_id: int
    positions: tuple[int, ...]     # each token's pass (its last position in the session's history)
    token_ids: tuple[int, ...]     # the tokens sampled from those passes (checked against the history)


@dataclass(frozen=True)
class ReplyAnalysed:
    request_id: int
    session_id: int
    positions: tuple[int, ...]
    fired: np.ndarray              # (n_layers, P) bool
    fired_features: tuple          # per layer, per position: the INSERTed features that fired


@dataclass(frozen=True)
class ShowLens:
    label: ClassVar[str] = "Logit lens"
    request_id: int
    session_id: int
    position: int
    token_id: int


@dataclass(frozen=True)
class LensResult:
    request_id: int
    lens: LogitLens


@dataclass(frozen=True)
class ShowFeatures:
    label: ClassVar[str] = "Feature view"
    request_id: int
    session_id: int
    position: int                  # the pass's last position in the session's history
    reply_before: tuple[int, ...]  # the reply's tokens sampled before this one (they end the pass's input)
    layer: int


@dataclass(frozen=True)
class ShowFeaturesOfIds:
    label: ClassVar[str] = "Feature view"
    request_id: int
    token_ids: tuple[int, ...]     # the pass's input; the view is of its last position
    layer: int


@dataclass(frozen=True)
class FeaturesResult:
    request_id: int
    view: FeatureView
    promoted: tuple[PromotedTokens, ...] = ()   # per row of the view: the tokens its down vector promotes


@dataclass(frozen=True)
class RunCollapse:
    label: ClassVar[str] = "Collapse lab"
    request_id: int
    prompts: tuple[str, ...]
    top_k: int | None           # None: the engine's default (79% of the intermediate size)
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass(frozen=True)
class CollapseProgress:
    request_id: int
    captured: int               # prompts measured so far
    total: int


@dataclass(frozen=True)
class CollapseResult:
    request_id: int
    report: CollapseReport


@dataclass(frozen=True)
class CollapseStopped:
    request_id: int
    captured: int               # prompts measured before the stop
    total: int


@dataclass(frozen=True)
class RunFrontier:
    label: ClassVar[str] = "Frontier"
    request_id: int
    prompts: tuple[str, ...]
    widths: tuple[int | None, ...]      # None: k' = K
    taus: tuple[float | None, ...]      # None: no guard
    max_tokens: int
    feature_set_hits: bool = False      # tau None: the seed's rule (any entry under the key), else the default
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass(frozen=True)
class FrontierProgress:
    request_id: int
    line: str
    done: int
    total: int


@dataclass(frozen=True)
class FrontierResult:
    request_id: int
    model: str
    top_k: int
    points: tuple[FrontierPoint, ...]
    bounds: tuple[FrontierPoint, ...]
    stopped: bool = False


# Every answer the worker sends besides the reply stream, model loading, statistics and errors: each has its own
# signal on EngineClient, named here (a panel connects to the answers it wants; no isinstance chains).
ANSWERS: dict[type, str] = {
    PatchesShown: "patches_shown", EngineActivity: "engine_activity", ServerState: "server_state",
    InsertProgress: "insert_progress", InsertCancelled: "insert_cancelled", InsertFinished: "insert_finished",
    ProbeAnswered: "probe_answered", FactProbed: "fact_probed", PatchSaved: "patch_saved",
    ReplyAnalysed: "reply_analysed", LensResult: "lens_shown", FeaturesResult: "features_shown",
    CollapseProgress: "collapse_progress", CollapseResult: "collapse_finished", CollapseStopped: "collapse_stopped",
    FrontierProgress: "frontier_progress", FrontierResult: "frontier_finished",
}
