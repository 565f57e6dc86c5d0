"""The labs' requests answered in the engine thread: the reply's pass (reply map, logit lens), the feature view,
the collapse lab and the frontier, beside engine_jobs (the chats' and patches' requests).

The worker puts these handlers in its one table (`EngineWorker`); each runs in the engine thread on what the
worker holds (`WorkerState`: the loaded model, its engine, the chat sessions) and hands its answers (frozen
snapshots from `protocol`) to `answer`, which the worker sends to the GUI thread. A raised ValueError becomes
the request's ErrorReport.
"""
from __future__ import annotations

from typing import Callable, Protocol

from larql_desktop.engine.analysis.collapse import CollapseCancelled, collapse
from larql_desktop.engine.analysis.features import FeatureView, feature_view
from larql_desktop.engine.analysis.lens import FeatureVocabulary, logit_lens
from larql_desktop.engine.analysis.reply_pass import ReplyPass, run_reply_pass
from larql_desktop.engine.cache.walk import WalkSettings
from larql_desktop.engine.core import LarqlEngine
from larql_desktop.engine.loading import LoadedModel
from larql_desktop.engine.session import ChatSession
from larql_desktop.qt.protocol import (AnalyseReply, CollapseProgress, CollapseResult, CollapseStopped, FeaturesResult,
                                       FrontierProgress, FrontierResult, LensResult, ReplyAnalysed, RunCollapse,
                                       RunFrontier, ShowFeatures, ShowFeaturesOfIds, ShowLens)
from larql_desktop.tools.measure import MeasurementStopped, run_frontier


class WorkerState(Protocol):
    """What a lab handler reads from the worker, in the engine thread."""
    model: LoadedModel | None
    engine: LarqlEngine | None
    sessions: dict[int, ChatSession]


class LabJobs:
    """The labs' handlers over one worker's state; keeps the last reply pass (the lens reads it again) and the
    promoted-token vocabulary of the loaded engine."""

    def __init__(self, state: WorkerState, answer: Callable[[object], None]):
        self.state = state
        self.answer = answer
        self._last: tuple | None = None   # (engine, session id, ids, ReplyPass, patch epoch) of the last pass
        self._vocabulary: tuple[LarqlEngine, FeatureVocabulary] | None = None

    def handlers(self) -> dict[type, Callable]:
        return {AnalyseReply: self.analyse_reply, ShowLens: self.lens, ShowFeatures: self.features,
                ShowFeaturesOfIds: self.features_of_ids, RunCollapse: self.collapse, RunFrontier: self.frontier}

    def _engine(self) -> LarqlEngine:
        if self.state.engine is None:
            raise ValueError("load a model first")
        return self.state.engine

    def _model(self) -> LoadedModel:
        if self.state.model is None:
            raise ValueError("load a model first")
        return self.state.model

    # --- the reply's pass: the reply map and the logit lens ---

    def _history_ids(self, session_id: int, positions, token_ids) -> list[int]:
        """The session's tokens up to the last pass, checked against the reply's tokens (ValueError if it moved
        on)."""
        self._engine()
        session = self.state.sessions.get(session_id)
        if session is None or not positions or min(positions) < 0:
            raise ValueError("this reply's chat session is gone (a reopened chat or another model): the pictures "
                             "need a reply generated since the model loaded")
        history = session.history
        last = max(positions)
        if last >= len(history):
            raise ValueError("the chat has moved on since this reply: its tokens are no longer in the session")
        for position, token in zip(positions, token_ids):
            if position + 1 < len(history) and history[position + 1] != token and position != last:
                raise ValueError("the chat has moved on since this reply (regenerated or edited): its tokens are "
                                 "no longer in the session")
        return list(history[:last + 1])

    def _pass(self, session_id: int, ids: list[int], positions: tuple[int, ...]) -> ReplyPass:
        engine = self._engine()
        last = self._last
        # The pass at a position depends only on the tokens up to it: a longer analysed pass answers too.
        if (last is not None and last[0] is engine and last[1] == session_id and last[2][:len(ids)] == tuple(ids)
                and set(positions) <= set(last[3].positions) and engine.patches.epoch == last[4]):
            return last[3]
        reply_pass = run_reply_pass(engine, ids, positions)
        self._last = (engine, session_id, tuple(ids), reply_pass, engine.patches.epoch)
        return reply_pass

    def analyse_reply(self, request: AnalyseReply) -> None:
        ids = self._history_ids(request.session_id, request.positions, request.token_ids)
        reply_pass = self._pass(request.session_id, ids, tuple(request.positions))
        index = [reply_pass.positions.index(p) for p in request.positions]
        self.answer(ReplyAnalysed(request.request_id, request.session_id, tuple(request.positions),
                                  reply_pass.fired[:, index].copy(),
                                  tuple(tuple(row[i] for i in index) for row in reply_pass.fired_features)))

    def lens(self, request: ShowLens) -> None:
        ids = self._history_ids(request.session_id, (request.position,), (request.token_id,))
        reply_pass = self._pass(request.session_id, ids, (request.position,))
        index = reply_pass.positions.index(request.position)
        self.answer(LensResult(request.request_id, logit_lens(self._engine().model, reply_pass, index,
                                                              request.token_id)))

    # --- the feature view ---

    def _features(self, request_id: int, view: FeatureView) -> FeaturesResult:
        engine = self._engine()
        if self._vocabulary is None or self._vocabulary[0] is not engine:   # a new engine, a new vocabulary
            self._vocabulary = (engine, FeatureVocabulary(engine))
        promoted = self._vocabulary[1].promoted(view.layer, [r.feature for r in view.rows])
        return FeaturesResult(request_id, view, promoted)

    def features(self, request: ShowFeatures) -> None:
        """The session's history up to the pass, checked against the reply, then the view."""
        engine = self._engine()
        session = self.state.sessions.get(request.session_id)
        if session is None or request.position < 0:
            raise ValueError("this reply's chat session is gone (a reopened chat or another model): "
                             "the feature view needs a reply generated since the model loaded")
        ids = session.history[:request.position + 1]
        before = list(request.reply_before)
        if len(ids) != request.position + 1 or (before and ids[len(ids) - len(before):] != before):
            raise ValueError("the chat has moved on since this reply (regenerated or edited): its tokens are no "
                             "longer in the session")
        self.answer(self._features(request.request_id, feature_view(engine, ids, request.layer)))

    def features_of_ids(self, request: ShowFeaturesOfIds) -> None:
        """Explicit token ids: the view of their last position."""
        engine = self._engine()
        self.answer(self._features(request.request_id, feature_view(engine, list(request.token_ids),
                                                                     request.layer)))

    # --- the collapse lab and the frontier ---

    def collapse(self, request: RunCollapse) -> None:
        """Measure on the loaded model, a CollapseProgress per captured prompt, then a CollapseResult (or
        CollapseStopped once request.cancel is set)."""
        model = self._model()
        captured = [0]

        def progress(done: int, total: int) -> None:
            captured[0] = done
            self.answer(CollapseProgress(request.request_id, done, total))

        try:
            report = collapse(model, list(request.prompts), top_k=request.top_k,
                              should_stop=request.cancel.is_set, progress=progress)
        except CollapseCancelled:
            self.answer(CollapseStopped(request.request_id, captured[0], len(request.prompts)))
            return
        self.answer(CollapseResult(request.request_id, report))

    def frontier(self, request: RunFrontier) -> None:
        """Run the sweep on the loaded model, reporting each design as it finishes."""
        model = self._model()
        total = len(request.widths) * len(request.taus) + len({t for t in request.taus if t is not None})
        done = [0]

        def log(line: str) -> None:
            done[0] += 1
            self.answer(FrontierProgress(request.request_id, line, done[0], total))

        top_k = WalkSettings().resolved(model.config.intermediate).top_k
        try:
            points, bounds = run_frontier(model, list(request.prompts), list(request.widths), list(request.taus),
                                          walk=WalkSettings(feature_set_hits=request.feature_set_hits),
                                          max_tokens=request.max_tokens, log=log,
                                          should_stop=lambda: request.cancel.is_set())
        except MeasurementStopped:
            self.answer(FrontierResult(request.request_id, model.name, top_k, (), (), stopped=True))
            return
        self.answer(FrontierResult(request.request_id, model.name, top_k, tuple(points), tuple(bounds)))
