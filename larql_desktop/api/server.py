"""Local HTTP API over a running LarqlEngine (FastAPI on uvicorn), for `larql-desktop serve` and the app.

Routes (an OpenAPI description is served at /openapi.json):
  POST   /v1/walk-ffn       one layer's walk FFN on a given normed FFN input, through the shared L2 (and L3)
  GET    /v1/cache-stats    the engine's statistics snapshot: per tier, per layer
  GET    /v1/model          what is loaded (sizes, default K, checksum)
  GET    /v1/patches        applied INSERT patches;  POST /v1/patches applies one (the body is the patch JSON)
  DELETE /v1/patches/{id}   removes one by its id;  POST /v1/insert installs a fact
  GET    /v1/health
  GET    /v1/models, POST /v1/chat/completions, POST /v1/completions: the OpenAI-compatible API (openai_compat.py)

Security: the server binds to loopback unless a token is given, and with a token every request needs
`Authorization: Bearer <token>`. On loopback the Host header must name loopback too (no DNS rebinding), POST
bodies must be JSON (so a web page cannot send a CORS-free "simple" request) and are capped in size. Every
malformed request gets a 4xx with a reason in `detail` before anything is run or changed.

Concurrency: walk requests run in uvicorn's thread pool, each with its own WalkFfn (no L1) over the shared,
locked L2 and the thread-safe L3 and statistics; onnxruntime sessions take concurrent runs. Patch changes are
the engine's own atomic operations (shared with the app's worker), named by each patch's stable content id, and
swap the engine's immutable overlay, so a walk in flight sees one overlay throughout.
Completions (openai_compat.py) run as engine sessions, one forward pass per fair turn on threads of their own.
Connections (connections.py): header, body and keep-alive timeouts and per-client caps, no 503 for everyone.
"""
from __future__ import annotations

import hmac
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal, Union

import fastapi.dependencies.models
import numpy as np
from fastapi import Body, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from larql_desktop.api import openai_compat
from larql_desktop.api.connections import ConnectionLimits, ConnectionRegistry, guarded_protocol
from larql_desktop.engine import services
from larql_desktop.engine.cache.keys import is_full_k
from larql_desktop.engine.completions import DEFAULT_BATCH_ROWS, decode_batch
from larql_desktop.engine.core import LarqlEngine, PatchAlreadyApplied, UnknownPatch
from larql_desktop.engine.patches.insert import Fact
from larql_desktop.engine.model.overlay import PatchError
from larql_desktop.engine.patches.summary import PatchSummary
from larql_desktop.engine.services import DEFAULT_API_HOST, DEFAULT_API_PORT, finite_json, is_loopback
DEFAULT_MAX_BODY = 8 * 1024 * 1024       # patch files carry base64 vectors; a residual is a few tens of KB
MAX_POSITIONS = 256
INPUT_NORM_MARGIN = 4.0     # residuals up to 4x the largest norm the model can produce are accepted
API_VERSION = "1"


# ----------------------------------------------------------------------------------------------- schemas
class WalkFfnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    layer: int = Field(description="layer index, 0-based")
    residual: Union[list[float], list[list[float]]] = Field(
        description="the normed FFN input: one vector of the hidden size, or a list of them (several positions "
                    "run as a prefill: computed, never cached)")
    top_k: int | None = Field(default=None, description="features selected by |gate score| (default: the engine's)")
    full_output: bool = Field(default=True, description="true: the FFN output; false: the selected features "
                                                        "and their gate scores only")


class WalkFfnResponse(BaseModel):
    layer: int
    top_k: int
    positions: int
    cache: Literal["hit", "miss", "bypass", "dense", "none"] = Field(
        description="hit/miss: the call consulted the cache; bypass: prefill, patched layer or cache off; "
                    "dense: K is at or above the full-K cut; none: features only, no FFN was run")
    hit: bool
    tier: str | None = Field(default=None, description="the tier that hit (L2 or L3)")
    bypass_reason: str | None = None
    output: list[float] | list[list[float]] | None = Field(default=None, description="the raw FFN output")
    features: list[int] | list[list[int]] | None = Field(default=None, description="by decreasing |score|")
    scores: list[float] | list[list[float]] | None = Field(default=None, description="signed gate scores")
    seconds: float


class InsertRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    entity: str = Field(min_length=1, max_length=200)
    relation: str = Field(min_length=1, max_length=200)
    target: str = Field(min_length=1, max_length=200)
    layer: int | None = None
    alpha: float = Field(default=0.1, gt=0.0, le=100.0, allow_inf_nan=False)
    paraphrases: list[Annotated[str, Field(min_length=1, max_length=500)]] = Field(
        default=[], max_length=32, description="other phrasings of the question to key the fact on")
    probes: bool = Field(default=True, description="answer with the fact's probe table (a few seconds more)")


class FactProbeInfo(BaseModel):
    kind: str = Field(description="canonical | paraphrase | generated | chat | qa")
    prompt: str
    rendered: str = Field(description="what the model reads (a chat question through the chat template)")
    before: str
    after: str
    p_before: float = Field(description="probability of the whole target word after the prompt, no patches")
    p_after: float
    answers_before: bool
    answers_after: bool


class PatchInfo(BaseModel):
    id: str = Field(description="stable content hash: DELETE /v1/patches/{id} removes this patch")
    name: str
    description: str
    base_model: str
    created_at: str
    operations: int
    layers: list[int]


class PatchList(BaseModel):
    epoch: str = Field(description="content hash of the applied overrides ('clean' without any)")
    patches: list[PatchInfo]


class InsertResponse(BaseModel):
    layer: int
    feature: int
    probability: float
    rounds: int
    patches: PatchList
    probes: list[FactProbeInfo] = Field(default=[], description="the fact's probe table (empty if not asked)")


class Problem(BaseModel):
    detail: str


ERRORS = {400: {"model": Problem}, 401: {"model": Problem}, 409: {"model": Problem}, 413: {"model": Problem},
          415: {"model": Problem}, 422: {"model": Problem}}


# ----------------------------------------------------------------------------------------------- guard
class _BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: bearer token, Host check on loopback, JSON-only bodies, body size cap."""

    def __init__(self, app, token: str | None, max_body: int, loopback_hosts: bool):
        self.app = app
        self.token = token.encode("utf-8") if token else None
        self.max_body = max_body
        self.loopback_hosts = loopback_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = [k.decode("latin-1").lower() for k, _ in scope["headers"]]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self._check_duplicates(names) or self._check(scope, headers)
        if problem is not None:
            return await self._refuse(send, *problem, path=scope["path"])
        received = 0

        async def capped_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    # FastAPI passes an HTTPException raised while reading the body on to its handler (any
                    # other exception there becomes a 400); _BodyTooLarge covers routes outside FastAPI.
                    raise HTTPException(413, f"request body exceeds {self.max_body} bytes")
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, capped_receive, tracking_send)
        except (_BodyTooLarge, HTTPException):
            if not started:
                await self._refuse(send, 413, f"request body exceeds {self.max_body} bytes", path=scope["path"])

    # Headers this guard decides on: sent twice, which one counts is a guess (a wrong token first and the right one
    # second was let in when the last one won), so a request that repeats one is refused.
    _SINGLE_HEADERS = ("authorization", "host", "content-type", "content-length")

    def _check_duplicates(self, names: list[str]):
        for name in self._SINGLE_HEADERS:
            if names.count(name) > 1:
                if name == "authorization" and self.token is not None:
                    return 401, "the Authorization header is sent more than once: send one bearer token", \
                        {"www-authenticate": "Bearer"}
                return 400, f"the {name} header is sent more than once: send it once", {}
        return None

    def _check(self, scope, headers):
        if self.loopback_hosts:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if not is_loopback(name):
                return 400, f"Host {host!r} is not a loopback name (this server only answers local requests)", {}
        if self.token is not None:
            auth = headers.get("authorization", "")
            scheme, _, given = auth.partition(" ")
            # ASGI hands header bytes over as latin-1 text: encoding back gives the client's bytes (UTF-8 for a
            # non-ASCII token), compared in constant time with the token's UTF-8.
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1"), self.token):
                return 401, "missing or wrong bearer token", {"www-authenticate": "Bearer"}
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "invalid Content-Length", {}
            if int(length) > self.max_body:
                return 413, f"request body exceeds {self.max_body} bytes", {}
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return 415, "the request body must be JSON (Content-Type: application/json)", {}
        return None

    @staticmethod
    async def _refuse(send, status, detail, extra=None, path: str = ""):
        # The OpenAI-compatible routes answer in the OpenAI error shape, whose clients read `error.message`.
        doc = openai_compat.error_doc(status, detail) if openai_compat.is_openai_path(path) else {"detail": detail}
        body = JSONResponse(doc).body
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# ----------------------------------------------------------------------------------------------- app
def max_ffn_input_norm(model) -> np.ndarray:
    """Per layer, the largest norm an FFN input of this model can have, times INPUT_NORM_MARGIN. The input is
    rms_norm(h) * w: h / rms(h) has norm sqrt(d) exactly, so |x| <= sqrt(d) * max|w| whatever h is
    (before the margin: SmolLM2 7.1 to 33 per layer, Gemma 3 270M 515 to 1784; real inputs measured up to 31
    and 60). Read from the norm weights alone: the fp32 attention weights stay undequantised (~100 MB)."""
    d = model.config.hidden
    return np.array([INPUT_NORM_MARGIN * np.sqrt(d) * float(np.abs(model.transformer.ffn_norm(i)).max())
                     for i in range(model.config.n_layers)])


def create_app(engine: LarqlEngine, *, token: str | None = None, max_body: int = DEFAULT_MAX_BODY,
               loopback_hosts: bool = True, generation_slots: int = 1,
               max_completions: int = openai_compat.DEFAULT_MAX_COMPLETIONS,
               batch_rows: int = DEFAULT_BATCH_ROWS, preload_batch: bool = False) -> FastAPI:
    cfg = engine.model.config
    input_norm_limit = max_ffn_input_norm(engine.model)
    app = FastAPI(title="larql-desktop local API", version=API_VERSION,
                  description="LARQL's walk FFN and its FFN activation cache over a model loaded in larql-desktop.")
    app.add_middleware(Guard, token=token, max_body=max_body, loopback_hosts=loopback_hosts)
    app.state.engine = engine
    # One forward pass at a time by default: on a small machine one pass already uses every core, and the
    # turns are handed out in arrival order, so concurrent completions interleave token by token.
    app.state.preparation = openai_compat.RequestPreparation()
    # Concurrent replies decode together, one forward pass per step for all of them (batch_rows 0: in turns).
    app.state.batch = batch = decode_batch(engine.model, batch_rows)
    if batch is not None and preload_batch:     # the batched graph the engine's FFN settings run, made now
        batch.load_session(walk=not engine.walk_settings.dense)
    app.state.turns = turns = openai_compat.FairTurns(generation_slots)
    app.include_router(openai_compat.openai_router(engine, turns, max_completions, app.state.preparation, max_body,
                                                   batch))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse({"detail": "the body is not valid JSON"}, status_code=400)
        parts = []
        for e in errors[:5]:
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
        return JSONResponse({"detail": "; ".join(parts)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, RecursionError):    # FastAPI's body parser hit Python's recursion limit
            return JSONResponse({"detail": "the body's JSON is nested too deeply"}, status_code=400)
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    def refuse(reason: str, status: int = 422):
        raise HTTPException(status_code=status, detail=reason)

    def patch_list(summaries: tuple[PatchSummary, ...], epoch: str) -> PatchList:
        return PatchList(epoch=epoch, patches=[
            PatchInfo(id=s.id, name=s.name, description=s.description, base_model=s.base_model,
                      created_at=s.created_at, operations=s.operations, layers=list(s.layers))
            for s in summaries])

    def changed(event) -> PatchList:
        return patch_list(event.patches, event.epoch)

    @app.get("/v1/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/model")
    def model_info() -> dict:
        walk = engine.walk_settings.resolved(cfg.intermediate)
        return {"name": engine.model.name, "checksum": engine.model.checksum, "architecture": cfg.arch,
                "n_layers": cfg.n_layers, "hidden": cfg.hidden, "intermediate": cfg.intermediate,
                "default_top_k": walk.top_k, "key_width": walk.key_width,
                "l3": engine.l3.status() if engine.l3 is not None else None}

    @app.post("/v1/walk-ffn", response_model=WalkFfnResponse, responses=ERRORS)
    def walk_ffn(req: WalkFfnRequest) -> dict:
        # Layer and K are checked by services.walk_ffn; the shape is checked here to name the bad row.
        single = not req.residual or not isinstance(req.residual[0], list)
        rows = [req.residual] if single else req.residual
        if not rows or len(rows) > MAX_POSITIONS:
            refuse(f"residual must hold 1..{MAX_POSITIONS} positions, not {len(rows)}")
        for i, row in enumerate(rows):
            if len(row) != cfg.hidden:
                where = "residual" if single else f"residual[{i}]"
                refuse(f"{where} has {len(row)} values, the model's hidden size is {cfg.hidden}")
        with np.errstate(over="ignore"):
            x = np.asarray(rows, dtype=np.float32)
        if not np.isfinite(x).all():
            refuse("residual contains NaN or infinity (or a value beyond float32)")
        if 0 <= req.layer < cfg.n_layers:       # (a bad layer is refused by services.walk_ffn)
            norms = np.sqrt(np.einsum("td,td->t", x.astype(np.float64), x.astype(np.float64)))
            limit = float(input_norm_limit[req.layer])
            if (norms > limit).any():
                refuse(f"residual norm {float(norms.max()):.4g} is beyond what layer {req.layer}'s FFN input can "
                       f"be (at most {limit / INPUT_NORM_MARGIN:.4g}: an RMS-normed vector; {limit:.4g} is accepted)")
        try:
            answer = services.walk_ffn(engine, req.layer, x, req.top_k, req.full_output)
        except ValueError as exc:
            refuse(str(exc))
        if answer.output is not None and not np.isfinite(answer.output).all():
            refuse("the FFN output overflowed float32 for this residual")    # and WalkFfn did not store it
        doc = {"layer": answer.layer, "top_k": answer.top_k, "positions": answer.positions, "cache": answer.outcome,
               "hit": answer.outcome == "hit", "seconds": answer.seconds}
        if answer.output is not None:
            doc.update(tier=answer.tier, bypass_reason=answer.bypass_reason,
                       output=answer.output[0].tolist() if single else answer.output.tolist())
        else:
            feats = [ids.tolist() for ids in answer.features]
            vals = [s.tolist() for s in answer.scores]
            doc.update(features=feats[0] if single else feats, scores=vals[0] if single else vals)
        return doc

    @app.get("/v1/cache-stats")
    def cache_stats() -> dict:
        doc = engine.snapshot().to_dict()
        doc["full_k"] = is_full_k(engine.walk_settings.resolved(cfg.intermediate).top_k, cfg.intermediate)
        doc["l3"] = engine.l3.status() if engine.l3 is not None else None
        doc["prefix_cache"] = engine.prefix_cache.stats().to_dict()
        doc["batch"] = batch.stats().to_dict() if batch is not None else None
        # Prefill chunks stopped between two layers so that a newly arrived shorter prompt ran first, and the
        # generation threads' busy seconds by kind of step.
        doc["scheduling"] = {"chunk_stops": turns.chunk_stops, "busy_seconds": turns.busy_seconds()}
        return finite_json(doc)

    @app.get("/v1/patches", response_model=PatchList)
    def list_patches():
        overlay = engine.patches   # one read: the list and its epoch describe the same state
        return patch_list(services.patch_summaries(overlay), overlay.epoch)

    @app.post("/v1/patches", response_model=PatchList, status_code=201, responses=ERRORS)
    def apply_patch(doc: dict[str, Any] = Body(description="a patch file's JSON (.vlp), or a patch set file's (all "
                                                           "of its patches, applied together or none)")):
        try:
            return changed(engine.apply_patches(engine.validate_patches(doc, source="patch"), origin="api"))
        except PatchAlreadyApplied as exc:
            refuse(str(exc), 409)
        except PatchError as exc:
            refuse(str(exc))

    @app.delete("/v1/patches/{patch_id}", response_model=PatchList, responses={404: {"model": Problem}})
    def remove_patch(patch_id: str):
        try:
            return changed(engine.remove_patch(patch_id, origin="api"))
        except UnknownPatch as exc:
            refuse(str(exc), 404)

    @app.post("/v1/insert", response_model=InsertResponse, responses=ERRORS)
    def insert(req: InsertRequest):
        if req.layer is not None and not 0 <= req.layer < cfg.n_layers:
            refuse(f"layer {req.layer} is out of range 0..{cfg.n_layers - 1}")
        try:
            fact = Fact(req.entity, req.relation, req.target)
            result = engine.insert(fact, layer=req.layer, alpha=req.alpha, paraphrases=req.paraphrases,
                                   origin="api")
        except ValueError as exc:
            refuse(str(exc))
        overlay = engine.patches
        probes = services.fact_probes(engine, fact, req.paraphrases, overlay=overlay) if req.probes else ()
        return InsertResponse(layer=result.layer, feature=result.feature, probability=result.probability,
                              rounds=result.rounds, patches=patch_list(services.patch_summaries(overlay), overlay.epoch),
                              probes=[FactProbeInfo(**asdict(p)) for p in probes])

    return app


# ----------------------------------------------------------------------------------------------- running
@dataclass
class ServerHandle:
    """A server running in a background thread. `url` is where it answers; `stop()` shuts it down."""
    url: str
    host: str
    port: int
    server: Any
    thread: threading.Thread
    connections: ConnectionRegistry | None = None   # open connections and what the limits closed

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        batch = getattr(getattr(self.server.config.app, "state", None), "batch", None)
        if batch is not None:       # its row threads end
            batch.close()
        forget_endpoints()

    def wait(self, poll: float = 0.5) -> None:
        while self.thread.is_alive():
            self.thread.join(poll)

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and self.server.started


def forget_endpoints() -> None:
    """Empty FastAPI's module-wide caches of endpoint functions. They keep the last 4096 endpoints a process
    served, and ours are closures over the engine and its decode batch: without this a stopped server held its
    engine, model sessions and batched decoder graphs for the life of the process (the test suite grew past
    20 GB; the window's API toggle kept one batched decoder per start). A running server only recomputes an
    entry on its next request."""
    for cached in list(vars(fastapi.dependencies.models).values()):
        if callable(getattr(cached, "cache_clear", None)):
            cached.cache_clear()


def _bind(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    if not infos:
        raise ValueError(f"cannot resolve {host!r}")
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def start_server(engine: LarqlEngine, host: str = DEFAULT_API_HOST, port: int = DEFAULT_API_PORT, token: str | None = None,
                 *, max_body: int = DEFAULT_MAX_BODY, limits: ConnectionLimits = ConnectionLimits(),
                 generation_slots: int = 1, max_completions: int = openai_compat.DEFAULT_MAX_COMPLETIONS,
                 batch_rows: int = DEFAULT_BATCH_ROWS, preload_batch: bool = False,
                 startup_timeout: float = 15.0) -> ServerHandle:
    """Serve `engine` (sharing its L2, L3 and statistics) from a background thread; port 0 picks a free one.

    A host other than loopback needs a token. Raises OSError when the address cannot be bound. `limits`: timeouts
    and connection caps (api/connections.py) instead of uvicorn's limit_concurrency, which answered everyone with
    503 once 64 idle connections were open."""
    import uvicorn

    if not is_loopback(host) and not token:
        raise ValueError(f"binding to {host} (not loopback) needs a token: clients then send "
                         "'Authorization: Bearer <token>'")
    if token is not None and len(token) < 16:
        raise ValueError("the token must be at least 16 characters")
    app = create_app(engine, token=token, max_body=max_body, loopback_hosts=is_loopback(host),
                     generation_slots=generation_slots, max_completions=max_completions, batch_rows=batch_rows, preload_batch=preload_batch)
    registry = ConnectionRegistry(limits)
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            http=guarded_protocol(registry), timeout_keep_alive=limits.keep_alive,
                            h11_max_incomplete_event_size=limits.max_header_bytes, timeout_graceful_shutdown=3,
                            server_header=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="larql-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    url_host = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
    return ServerHandle(f"http://{url_host}:{bound}", host, bound, server, thread, registry)
