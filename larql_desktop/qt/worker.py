"""The engine worker: one QObject in one QThread that owns the loaded model and every chat session.

The GUI thread never loads models or runs a forward pass. It talks to the worker only through
`EngineClient`: requests (frozen dataclasses from `protocol`) go in through a queued signal, snapshots
come back through the worker's signals, which the client re-emits from the GUI thread.

Generation blocks the worker's event loop for the length of a reply (the worker steps the engine's
generator itself), so stopping is a `threading.Event` carried by the request and checked between
tokens, and queued requests simply wait their turn (an INSERT likewise).

Each loaded model gets one `LarqlEngine` (shared L2 cache, process-wide statistics); each chat is one of its
sessions. The worker subscribes to the engine's change events, so patches applied by an HTTP client reach the
window the moment they are made, from whichever thread made them (a signal emitted there is queued to the GUI).
The HTTP API itself is started and stopped here, on the engine the worker owns (`serve` is given by main()), so
the GUI thread never holds the engine. The persistent L3 store, if the app opened one, is given to the worker and attached to every engine it
builds (the worker never closes it: whoever opened it does, after the thread has ended). While a reply streams, the worker sends its tokens in batches at most every TOKEN_BATCH_INTERVAL seconds
(the client re-emits them one by one) and a stats snapshot at most every STATS_INTERVAL seconds and once at its
end; the monitor redraws on its own timer, never per token.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from dataclasses import replace
from typing import Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from larql_desktop.engine.catalog import PACKAGED_MODELS
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.cache.l3 import L3Store
from larql_desktop.engine.paths import AppPaths
from larql_desktop.engine.loading import LoadedModel, load_model
from larql_desktop.engine.session import ChatSession, ReplyStream, checked_messages
from larql_desktop.qt import engine_jobs
from larql_desktop.qt.lab_jobs import LabJobs
from larql_desktop.qt.cache_monitor_model import cache_counts
from larql_desktop.engine.core import CacheSettings
from larql_desktop.engine.core import PatchesChanged
from larql_desktop.engine.patches.applied import AppliedPatchStore
from larql_desktop.engine.patches import insert as inserting
from larql_desktop.engine.patches.insert.capture_store import CaptureStore
from larql_desktop.engine.services import DEFAULT_API_HOST
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.qt.protocol import (ANSWERS, ClearCaches, CloseSession, OpenChat, SetSystemPrompt, ConfigureCache, EngineActivity, ErrorReport,
                                       InsertCancelled, InsertFact, InsertProgress, LoadModel, LoadPatchFile, ModelInfo, ProbeFact, ProbePrompt,
                                       Regenerate, RemovePatch, ReplyFinished, ReplyStarted, RequestStats, ResetStats,
                                       SavePatch, SavePatchSet, SendPrompt, ServerState, StartServer, StopServer,
                                       TokenEvent)
from larql_desktop.qt.reply_stats import FAILED, STOPPED, ReplyStatsBuilder

log = logging.getLogger(__name__)


# Tokens reach the GUI thread in batches at most this often (the first of a reply and the last at once): one
# queued signal per token woke the GUI thread 50-100 times a second, and on two cores each wake-up (the event
# dispatch, the relay, the GIL handed over and back) took ~1 ms per token from the decode; the chat shows
# streamed text every 50 ms (qt_chat_tab.APPEND_INTERVAL_MS) anyway.
TOKEN_BATCH_INTERVAL = 0.04
STATS_INTERVAL = 1.0   # seconds between stats snapshots while a reply streams (the monitor redraws every 2 s then;
# each snapshot costs the engine thread 1-2 ms, 0.2 ms a token at 0.5 s on Gemma)


class LoadCancelled(Exception):
    """Raised from a progress callback (model load, INSERT) when the app shuts down mid-way."""


def model_info(request_id: int, model: LoadedModel) -> ModelInfo:
    spec = model.spec
    return ModelInfo(request_id, model.name, spec is not None, spec.display_name if spec else model.path.name, model.path,
                     model.is_chat, model.config.arch, model.config.n_layers, model.config.hidden,
                     model.config.vocab_size, model.context_limit, model.load_seconds, model.threads,
                     model.config.intermediate, model.default_system_prompt)


class EngineWorker(QObject):
    """Lives in the engine thread. Its slots and handlers run there; it never touches a widget."""

    model_loaded = Signal(object)        # ModelInfo
    load_progress = Signal(str, float)   # message, fraction 0..1
    reply_started = Signal(object)       # ReplyStarted
    tokens = Signal(object)              # tuple[TokenEvent, ...]: a reply's next tokens, in order
    reply_finished = Signal(object)      # ReplyFinished
    error = Signal(object)               # ErrorReport
    stats = Signal(object)               # CacheStatsEvent
    answer = Signal(object)              # any other answer: one of protocol.ANSWERS (the client routes it by type)

    def __init__(self, paths: AppPaths, loader: Callable[..., LoadedModel] = load_model, l3: L3Store | None = None,
                 serve: Callable | None = None, applied: AppliedPatchStore | None = None,
                 capture_store: CaptureStore | None = None):
        super().__init__()
        self._applied = applied                  # where each model's applied patches are kept between launches
        self._paths = paths
        self.l3 = l3
        # INSERT's negatives' captures between launches, shared by every model's engine (namespaced by model).
        self.capture_store = capture_store
        self._loader = loader
        self._serve = serve                      # serve(engine, host, port) -> handle with .url and .stop()
        self._server = None                      # the running server's handle
        self._server_port: int | None = None     # the port the user wants served (None: not serving)
        self._unsubscribe: Callable[[], None] | None = None
        self._shutdown = threading.Event()
        self.model: LoadedModel | None = None
        self.engine: LarqlEngine | None = None
        self.sessions: dict[int, ChatSession] = {}
        # Conversations without a session yet (opened before a model loaded, or carried over a model change):
        # the session made for that chat starts from it.
        self._waiting: dict[int, tuple[tuple[tuple[str, str], ...], str | None]] = {}
        self.cache_settings = CacheSettings()   # applied to the next model's engine too
        self._engine_ids = itertools.count(1)
        self._engine_id = 0
        self._active_session: int | None = None
        self._handlers: dict[type, Callable[[object], None]] = {
            LoadModel: self._load_model,
            SendPrompt: self._send_prompt,
            Regenerate: self._regenerate,
            OpenChat: self._open_chat,
            SetSystemPrompt: self._set_system_prompt,
            CloseSession: self._close_session,
            ConfigureCache: self._configure_cache,
            ClearCaches: self._clear_caches,
            ResetStats: self._reset_stats,
            RequestStats: self._request_stats,
            InsertFact: self._insert_fact,
            ProbePrompt: self._probe,
            ProbeFact: lambda r: self.answer.emit(engine_jobs.fact_probes(self._engine(), r)),
            LoadPatchFile: self._load_patch_file,
            RemovePatch: self._remove_patch,
            SavePatch: lambda r: self.answer.emit(engine_jobs.save_patch(self._engine(), r)),
            SavePatchSet: lambda r: self.answer.emit(engine_jobs.save_patch_set(self._engine(), r)),
            StartServer: self._start_server,
            StopServer: self._stop_server,
            **LabJobs(self, self.answer.emit).handlers(),
        }

    def request_shutdown(self) -> None:
        """Thread-safe: makes the running handler return at its next check and drops queued requests."""
        self._shutdown.set()

    def release(self) -> None:
        """Stop serving and drop the engine objects. Call only once the thread has finished."""
        self._stop_serving()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self.sessions.clear()
        self.engine = None
        self.model = None

    @Slot(object)
    def handle(self, request: object) -> None:
        if self._shutdown.is_set():
            return
        threading.current_thread().name = "engine"   # for the log file (Python names a Qt thread Dummy-N)
        handler = self._handlers.get(type(request))
        session_id = getattr(request, "session_id", None)
        request_id = getattr(request, "request_id", None)
        if handler is None:
            self.error.emit(ErrorReport(request_id, session_id, "Engine",
                                        f"no handler for {type(request).__name__} requests"))
            return
        try:
            handler(request)
        except LoadCancelled:
            log.info("model loading cancelled by shutdown")
        except (ValueError, OSError) as exc:   # bad input, bad file: the message is for the user
            log.info("%s failed: %s", type(request).__name__, exc)
            self.error.emit(ErrorReport(request_id, session_id, _context(request), str(exc)))
        except Exception as exc:               # a bug: keep the traceback in the log, tell the user
            log.exception("%s failed", type(request).__name__)
            self.error.emit(ErrorReport(request_id, session_id, _context(request),
                                        f"{type(exc).__name__}: {exc} (details in the log file)"))

    # --- handlers ---

    def _load_model(self, request: LoadModel) -> None:
        def progress(message: str, fraction: float) -> None:
            if self._shutdown.is_set():
                raise LoadCancelled()
            self.load_progress.emit(message, float(fraction))

        progress(f"Loading {request.name_or_path}", 0.0)
        c = self.cache_settings
        # Sessions for what the current FFN mode runs; the other set is made on first use after a switch.
        model = self._loader(request.name_or_path, self._paths, threads=request.threads, progress=progress,
                             preload="decoder" if c.walk.dense else "layers")
        try:
            engine = LarqlEngine(model, walk=c.walk, l1=c.l1, l2=c.l2, l3=self.l3, capture_store=self.capture_store)
        except ValueError:   # e.g. a K the previous model allowed but this one has not: start from defaults
            log.info("cache settings %s do not fit %s; using the defaults", c, model.name)
            self.cache_settings = replace(CacheSettings(), l3=c.l3)
            engine = LarqlEngine(model, l3=self.l3, capture_store=self.capture_store)
        # Only a successful load replaces the old model; the sessions (and patches) belonged to the old one.
        if self._unsubscribe is not None:
            self._unsubscribe()
        restored, problems = self._applied.load(engine) if self._applied is not None else ([], [])
        if restored:
            engine.apply_patches(restored)
        self._unsubscribe = engine.subscribe(lambda event: self._on_engine_event(engine, event))
        self.model, self.engine = model, engine
        self._engine_id = next(self._engine_ids)
        for session_id, session in self.sessions.items():   # the conversations continue on the new model
            self._waiting[session_id] = (session.transcript(), session.system_prompt)
        self.sessions.clear()
        self._active_session = None
        self.load_progress.emit(f"Loaded {model.name}", 1.0)
        self.model_loaded.emit(model_info(request.request_id, model))
        self.answer.emit(engine_jobs.current_patches(engine, request.request_id))
        for problem in problems:
            self.error.emit(ErrorReport(None, None, "Restoring patches", problem))
        self._emit_stats()
        if self._server_port is not None:   # the old engine is gone: serve the new one on the same port
            self._serve_now(0)

    def _engine(self) -> LarqlEngine:
        if self.engine is None:
            raise ValueError("no model is loaded yet")
        return self.engine

    def _session(self, session_id: int) -> ChatSession:
        engine = self._engine()
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = engine.new_session()   # its own L1, the shared L2
            waiting = self._waiting.pop(session_id, None)
            if waiting is not None:
                session.restore(*waiting)
        return session

    def _on_engine_event(self, engine: LarqlEngine, event) -> None:
        """Runs in whichever thread changed the engine (this one, or an HTTP request's): emits signals and keeps
        the applied patches on disk."""
        if isinstance(event, PatchesChanged):
            if self._applied is not None:
                self._applied.save(engine.model.checksum, engine.applied_patches)   # the newest list, whoever wins
            self.answer.emit(engine_jobs.patches_changed(event))
        elif not (isinstance(event.origin, tuple) and event.origin[:1] == ("window",)):
            self.answer.emit(EngineActivity(event.version))   # the window asks for a snapshot when it is free

    def _emit_stats(self) -> None:
        if self.engine is not None:
            session_id = self._active_session
            self.stats.emit(engine_jobs.stats_event(self.engine, self._engine_id, session_id,
                                                    self.sessions.get(session_id)))

    def _open_chat(self, request: OpenChat) -> None:
        conversation = (checked_messages(request.messages), request.system_prompt)   # refused: nothing changes
        session = self.sessions.get(request.session_id)
        if session is not None:
            session.restore(*conversation)
        else:
            self._waiting[request.session_id] = conversation

    def _set_system_prompt(self, request: SetSystemPrompt) -> None:
        session = self.sessions.get(request.session_id)
        if session is not None:
            session.system_prompt = request.system_prompt
        else:
            messages, _ = self._waiting.get(request.session_id, ((), None))
            self._waiting[request.session_id] = (messages, request.system_prompt)

    def _send_prompt(self, request: SendPrompt) -> None:
        session = self._session(request.session_id)
        steps = session.reply(request.text, request.settings)   # refuses bad prompts before changing anything
        self._stream(request.request_id, request.session_id, session, steps, request.cancel, request.text)

    def _regenerate(self, request: Regenerate) -> None:
        session = self._session(request.session_id)
        steps = session.regenerate(request.settings)
        self._stream(request.request_id, request.session_id, session, steps, request.cancel, None)

    def _close_session(self, request: CloseSession) -> None:
        self._waiting.pop(request.session_id, None)
        session = self.sessions.pop(request.session_id, None)
        if session is not None and self.engine is not None:
            self.engine.close_session(session)
        if self._active_session == request.session_id:
            self._active_session = None
        self._emit_stats()

    def _configure_cache(self, request: ConfigureCache) -> None:
        c = request.settings
        if self.engine is not None:
            # Without an L3 store the L3 settings have nothing to apply to (the monitor shows L3 unavailable).
            self.engine.configure(walk=c.walk, l1=c.l1, l2=c.l2, l3=c.l3 if self.engine.l3 is not None else None,
                                  origin=("window", request.request_id))   # ValueError: nothing changes
        elif self.l3 is not None:
            self.l3.configure(c.l3)
        self.cache_settings = c
        self._emit_stats()

    def _clear_caches(self, request: ClearCaches) -> None:
        if self.engine is None and request.persistent and self.l3 is not None:
            self.l3.clear()   # the persistent store needs no model
            return
        self._engine().clear_caches(persistent=request.persistent, origin=("window", request.request_id))
        self._emit_stats()

    def _reset_stats(self, request: ResetStats) -> None:
        self._engine().reset_stats(origin=("window", request.request_id))
        self._emit_stats()

    def _request_stats(self, request: RequestStats) -> None:
        self._active_session = request.session_id
        self._emit_stats()

    def _insert_fact(self, request: InsertFact) -> None:
        engine = self._engine()

        def progress(message: str, fraction: float) -> None:
            if self._shutdown.is_set():
                raise LoadCancelled()
            self.answer.emit(InsertProgress(request.request_id, message, float(fraction)))

        try:   # the user's Cancel reaches the inserter as request.cancel, checked between its steps
            finished = engine_jobs.insert_fact(engine, request, progress)   # the engine's event lists the patches
        except inserting.InsertCancelled:
            self.answer.emit(InsertCancelled(request.request_id))   # the patch is applied only at the very end
            return
        self._emit_stats()
        if request.probe.strip():
            self.answer.emit(engine_jobs.probe(engine, ProbePrompt(request.request_id, request.probe,
                                                                  request.target)))
        # The fact where people ask it: its prompt, the paraphrases and a chat question, before and after.
        self.answer.emit(engine_jobs.fact_probes(engine, ProbeFact(request.request_id, request.entity,
                                                                  request.relation, request.target,
                                                                  request.paraphrases)))
        self.answer.emit(finished)   # last: the INSERT's answers are complete

    def _probe(self, request: ProbePrompt) -> None:
        self.answer.emit(engine_jobs.probe(self._engine(), request))

    def _load_patch_file(self, request: LoadPatchFile) -> None:
        engine = self._engine()
        # PatchError names the problem and nothing is applied; the engine's event lists the patches.
        engine.apply_patches(engine.read_patches(request.path), origin=("window", request.request_id))
        self._emit_stats()

    def _remove_patch(self, request: RemovePatch) -> None:
        self._engine().remove_patch(request.patch_id, origin=("window", request.request_id))
        self._emit_stats()

    # --- the HTTP API over this worker's engine ---

    def _start_server(self, request: StartServer) -> None:
        if self._serve is None or not 0 <= request.port <= 65535:
            problem = "this app was started without the HTTP API" if self._serve is None else \
                f"port {request.port} is out of range 0..65535"
            self.answer.emit(ServerState(request.request_id, None, problem))
            return
        self._server_port = request.port
        self._serve_now(request.request_id)

    def _stop_server(self, request: StopServer) -> None:
        self._server_port = None
        self._stop_serving()
        self.answer.emit(ServerState(request.request_id, None))

    def _serve_now(self, request_id: int) -> None:
        """(Re)start serving the current engine on the wanted port; a failure is reported and stops wanting it."""
        self._stop_serving()
        if self.engine is None:
            self.answer.emit(ServerState(request_id, None))   # starts once a model is loaded
            return
        try:
            self._server = self._serve(self.engine, DEFAULT_API_HOST, self._server_port)
        except (OSError, ValueError, RuntimeError) as exc:
            self._server_port = None
            self.answer.emit(ServerState(request_id, None, str(exc) or type(exc).__name__))
            return
        log.info("HTTP API serving %s on %s", self.model.name, self._server.url)
        self.answer.emit(ServerState(request_id, self._server.url))

    def _stop_serving(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
            log.info("HTTP API on %s stopped", server.url)

    def _stream(self, request_id: int, session_id: int, session: ChatSession, steps: ReplyStream,
                cancel: threading.Event, prompt: str | None) -> None:
        self.reply_started.emit(ReplyStarted(request_id, session_id, prompt))
        self._active_session = session_id
        engine = self._engine()
        before = engine.session_snapshot(session)
        stats = ReplyStatsBuilder()
        outcome = FAILED
        last_stats = time.monotonic()
        held: list[TokenEvent] = []     # tokens not yet sent to the GUI thread (see TOKEN_BATCH_INTERVAL)
        last_sent = -math.inf
        try:
            while True:
                if cancel.is_set() or self._shutdown.is_set():
                    outcome = STOPPED
                    break
                try:
                    step = next(steps)
                except StopIteration:
                    outcome = stats.natural_outcome()
                    break
                stats.add(step)
                # The history holds the prompt and the reply's tokens before this one: its last is the pass's.
                held.append(TokenEvent.from_step(request_id, session_id, step, len(session.history) - 1))
                now = time.monotonic()
                if now - last_sent >= TOKEN_BATCH_INTERVAL:
                    self.tokens.emit(tuple(held))
                    held.clear()
                    last_sent = now
                if now - last_stats >= STATS_INTERVAL:
                    self._emit_stats()
                    last_stats = time.monotonic()   # after the snapshot: the interval is between snapshots
        finally:
            if held:
                self.tokens.emit(tuple(held))
            steps.close()   # ends the reply: its final text (any held-back UTF-8 tail included) is settled
            text = steps.text
            counts = cache_counts(before, engine.session_snapshot(session))
            self.reply_finished.emit(ReplyFinished(request_id, session_id, text, stats.finish(outcome, counts)))
            self._emit_stats()


def _context(request: object) -> str:
    """What failed, in the user's words: the request's label (a model's load names the model)."""
    if isinstance(request, LoadModel):
        name = request.name_or_path
        return f"Loading {PACKAGED_MODELS[name].display_name if name in PACKAGED_MODELS else name}"
    return getattr(type(request), "label", type(request).__name__)


class EngineClient(QObject):
    """The GUI thread's handle on the engine: owns the thread and the worker, sends requests, relays results.

    Every signal here is emitted in the GUI thread (the worker's signals arrive through queued slots),
    so widgets and pytest-qt's waitSignal can connect to it directly. It also tracks the little state the
    GUI needs to enable its actions: the loaded model, whether a load or a reply is in flight.
    """

    model_loaded = Signal(object)
    load_progress = Signal(str, float)
    reply_started = Signal(object)
    token = Signal(object)               # TokenEvent: each streamed token, one by one
    tokens = Signal(object)              # tuple[TokenEvent, ...]: the same tokens as the worker batched them
    reply_finished = Signal(object)
    error = Signal(object)
    stats = Signal(object)
    busy_changed = Signal()
    # One signal per answer type (protocol.ANSWERS): a panel connects to the answers it wants and routes them by
    # request_id, as it does errors.
    patches_shown = Signal(object)       # PatchesShown: the applied patches changed (this window or an HTTP client)
    engine_activity = Signal(object)     # EngineActivity: an HTTP client moved the statistics
    server_state = Signal(object)        # ServerState
    insert_progress = Signal(object)     # InsertProgress
    insert_cancelled = Signal(object)    # InsertCancelled
    insert_finished = Signal(object)     # InsertFinished
    probe_answered = Signal(object)      # ProbeAnswered
    fact_probed = Signal(object)         # FactProbed
    patch_saved = Signal(object)         # PatchSaved
    reply_analysed = Signal(object)      # ReplyAnalysed
    lens_shown = Signal(object)          # LensResult
    features_shown = Signal(object)      # FeaturesResult
    collapse_progress = Signal(object)   # CollapseProgress
    collapse_finished = Signal(object)   # CollapseResult
    collapse_stopped = Signal(object)    # CollapseStopped
    frontier_progress = Signal(object)   # FrontierProgress
    frontier_finished = Signal(object)   # FrontierResult

    _submit = Signal(object)

    def __init__(self, paths: AppPaths, threads: int = 2, loader: Callable[..., LoadedModel] = load_model,
                 parent: QObject | None = None, l3: L3Store | None = None, serve: Callable | None = None,
                 applied: AppliedPatchStore | None = None, capture_store: CaptureStore | None = None):
        super().__init__(parent)
        self.threads = threads
        self.paths = paths   # where the window keeps its saved chats
        self.model: ModelInfo | None = None
        self._ids = itertools.count(1)
        self._pending_load: int | None = None
        self._generation: SendPrompt | Regenerate | None = None   # the reply in flight, if any
        self._thread = QThread()
        self._thread.setObjectName("larql-engine")
        self.l3 = l3   # the persistent tier the worker attaches to every engine (closed by its opener)
        self.can_serve = serve is not None
        self.worker = EngineWorker(paths, loader, l3, serve, applied, capture_store)
        self.worker.moveToThread(self._thread)
        self._submit.connect(self.worker.handle)
        self.worker.model_loaded.connect(self._on_model_loaded)
        self.worker.load_progress.connect(self._on_load_progress)
        self.worker.reply_started.connect(self._on_reply_started)
        self.worker.tokens.connect(self._on_tokens)
        self.worker.reply_finished.connect(self._on_reply_finished)
        self.worker.error.connect(self._on_error)
        self.worker.stats.connect(self._on_stats)
        self.worker.answer.connect(self._on_answer)
        self._answer_signals = {kind: getattr(self, name) for kind, name in ANSWERS.items()}
        self._thread.start()

    # --- state ---

    @property
    def loading(self) -> bool:
        return self._pending_load is not None

    @property
    def generating_session(self) -> int | None:
        return self._generation.session_id if self._generation else None

    @property
    def ready(self) -> bool:
        """A model is loaded and nothing is in flight: a new reply can start."""
        return self.model is not None and not self.loading and self._generation is None

    def is_running(self) -> bool:
        return self._thread.isRunning()

    # --- requests ---

    def next_request_id(self) -> int:
        return next(self._ids)

    def submit(self, request: object) -> None:
        """Send a request (one of protocol's) to the worker."""
        if not self._thread.isRunning():
            raise RuntimeError("the engine thread has been shut down")
        self._submit.emit(request)

    def load_model(self, name_or_path: str) -> int:
        self.stop()
        request = LoadModel(self.next_request_id(), name_or_path, self.threads)
        self._pending_load = request.request_id
        self.submit(request)
        self.busy_changed.emit()
        return request.request_id

    def open_chat(self, session_id: int, messages: tuple[tuple[str, str], ...], system_prompt: str | None) -> int:
        """Hand a saved chat's conversation to its session (once: the session holds it from then on)."""
        request = OpenChat(self.next_request_id(), session_id, tuple(messages), system_prompt)
        self.submit(request)
        return request.request_id

    def set_system_prompt(self, session_id: int, system_prompt: str | None) -> None:
        self.submit(SetSystemPrompt(self.next_request_id(), session_id, system_prompt))

    def send_prompt(self, session_id: int, text: str, settings: SamplingSettings) -> int:
        return self._start(SendPrompt(self.next_request_id(), session_id, text, settings))

    def regenerate(self, session_id: int, settings: SamplingSettings) -> int:
        return self._start(Regenerate(self.next_request_id(), session_id, settings))

    def _start(self, request: SendPrompt | Regenerate) -> int:
        if self._generation is not None:
            raise RuntimeError("a reply is already being generated")
        self._generation = request
        self.submit(request)
        self.busy_changed.emit()
        return request.request_id

    def close_session(self, session_id: int) -> None:
        if self.generating_session == session_id:
            self.stop()
        self.submit(CloseSession(self.next_request_id(), session_id))

    def stop(self) -> None:
        """Stop the reply in flight after its current token. Safe to call at any time."""
        if self._generation is not None:
            self._generation.cancel.set()

    def shutdown(self) -> None:
        """Stop everything, end the thread and wait for it. Idempotent."""
        self.stop()
        self.worker.request_shutdown()
        if self._thread.isRunning():
            self._thread.quit()
            self._thread.wait()
        self.worker.release()

    # --- relays (run in the GUI thread) ---

    @Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        self.model = info
        if self._pending_load == info.request_id:
            self._pending_load = None
        self.model_loaded.emit(info)
        self.busy_changed.emit()

    @Slot(str, float)
    def _on_load_progress(self, message: str, fraction: float) -> None:
        self.load_progress.emit(message, fraction)

    @Slot(object)
    def _on_reply_started(self, started: ReplyStarted) -> None:
        self.reply_started.emit(started)

    @Slot(object)
    def _on_tokens(self, events: tuple[TokenEvent, ...]) -> None:
        self.tokens.emit(events)
        for event in events:
            self.token.emit(event)

    @Slot(object)
    def _on_reply_finished(self, finished: ReplyFinished) -> None:
        if self._generation is not None and self._generation.request_id == finished.request_id:
            self._generation = None
        self.reply_finished.emit(finished)
        self.busy_changed.emit()

    @Slot(object)
    def _on_error(self, report: ErrorReport) -> None:
        changed = False
        if self._pending_load is not None and self._pending_load == report.request_id:
            self._pending_load = None
            changed = True
        # A refused prompt never starts a reply, so the error is its only answer.
        if self._generation is not None and self._generation.request_id == report.request_id:
            self._generation = None
            changed = True
        self.error.emit(report)
        if changed:
            self.busy_changed.emit()

    @Slot(object)
    def _on_stats(self, event: object) -> None:
        self.stats.emit(event)

    @Slot(object)
    def _on_answer(self, answer: object) -> None:
        self._answer_signals[type(answer)].emit(answer)   # a type missing from ANSWERS is a bug: it raises
