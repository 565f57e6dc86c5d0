"""The OpenAI-compatible part of the local API: what editors, notebooks, LangChain and Open WebUI speak.

Routes (mounted by server.create_app next to the engine's own /v1 routes):
  GET  /v1/models, /v1/models/{id}   the loaded model (one id: the engine's model name, e.g. "smollm2")
  POST /v1/chat/completions          messages rendered with the model's chat template
  POST /v1/completions               a raw prompt (the way to use a base model such as Gemma 3 270M)
Both POST routes stream as server-sent events when `stream` is true (`data: {chunk}` lines, then `data: [DONE]`).

Each request runs as its own engine session (its own L1) through the engine's current FFN settings, sharing L2 and
L3 with every other client and with the app's chats, and is closed when it ends. Every response carries, beside
`usage`, an extension field `larql_cache`: that request's FFN cache counts (hits and misses per tier, lookups that
every tier missed, bypasses by reason), in a streamed reply on the chunk that carries the finish reason.

Chat completions need a chat template: a base model (no template) is refused with a 400 that points to
/v1/completions, rather than inventing a "role: content" format the model was never trained on.

Prompts share their KV through the engine's prefix cache (engine/model/prefix_cache.py): `usage.prompt_tokens_details.
cached_tokens` says how many prompt positions a request reused. `logprobs`/`top_logprobs` report the log-softmax of
the engine's raw logits (requested_logprobs, chat_logprobs, completion_logprobs below).

Scheduling: a request advances one forward pass (a prefill chunk or a decode step) per turn and turns are handed out first come, first served
(`FairTurns`), so with many streaming clients each one progresses at its share of the engine; a client that goes
away ends its request at the next turn (its session is closed, its slot freed). Waiting for a turn holds no thread.
A request waiting for its first turn with a prompt shorter than what a running prefill still has to run stops
that prefill's chunk between two layers (once per chunk, session.prefill_steps): it waits for one layer of the long
prompt's chunk rather than the whole chunk, and the long prompt takes its chunk up again at its next turn.
Once its prompt has run, a reply joins the decode batch when there is one (engine/model/batch.py): `BatchTurns`
then takes one turn per step for all the replies in it, which decode together in one forward pass.

Errors on these routes use the OpenAI error object {"error": {"message", "type", "param", "code"}} (a 4xx, and
nothing has run); the engine's own routes keep their {"detail": ...} shape. A request's body is read up to a size
its model's context can use, then parsed, checked (as strictly as the OpenAI API), templated and tokenised in a
preparation thread, off the event loop (openai_input.py): a large body delays only its own answer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

import anyio.to_thread
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect

from larql_desktop.api.openai_input import (ApiError, RequestPreparation, body_limit, decode_json, error_doc,
                                            read_body, refuse_unsupported_chat_fields, validation_error)
from larql_desktop.engine.completions import CompletionRun, PromptTooLong
from larql_desktop.engine.formats.chat_template import ChatTemplateError
from larql_desktop.engine.formats.tokenizer import TextTooLong
from larql_desktop.engine.model.generation import SamplingSettings
from larql_desktop.engine.model.logprobs import MAX_TOP_LOGPROBS
from larql_desktop.engine.model.stops import checked_stop_strings

log = logging.getLogger(__name__)

OPENAI_PATHS = ("/v1/models", "/v1/chat/completions", "/v1/completions")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
DEFAULT_TEMPERATURE = 1.0     # the OpenAI API's default (the app's own chats default to greedy)
DEFAULT_MAX_COMPLETIONS = 32  # sessions held at once by API requests (SmolLM2's KV cache: ~12 MB per 256 tokens)


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


# ----------------------------------------------------------------------------------------------- scheduling
# What a turn's step is: a chunk of a prompt (and the first token sampled from its end), one reply's decode step,
# or a step of every reply in the decode batch.
TURN_KINDS = ("prefill", "decode", "batched decode")


class FairTurns:
    """An asyncio semaphore that hands its `slots` out strictly in arrival order (a request that takes a turn
    queues again behind everyone already waiting), so concurrent generations interleave step by step.

    `run(fn)` runs one step in the turn-holder's thread: the steps run on `slots` threads of their own (a forward
    pass keeps per-thread onnxruntime bindings warm; hopping over a large pool would rebuild them), never on the
    thread pool that serves the other routes."""

    def __init__(self, slots: int = 1):
        if slots < 1:
            raise ValueError("at least one generation slot is needed")
        self._free = slots
        self._waiting: deque[asyncio.Future] = deque()
        self._threads = ThreadPoolExecutor(slots, thread_name_prefix="larql-generate")
        # Prompt positions of the requests waiting for their first turn, read from the generation threads.
        self._newcomers: dict[object, int] = {}
        self._newcomers_lock = threading.Lock()
        self.chunk_stops = 0        # prefill chunks stopped between layers for a newcomer (generation threads)
        # Seconds the generation threads spent in steps, by kind (TURN_KINDS): where a load's time goes (a batch
        # of decode rows against the prompts' prefill), without a profiler.
        self._busy = dict.fromkeys(TURN_KINDS, 0.0)
        self._busy_lock = threading.Lock()

    async def run(self, fn, newcomer: int | None = None, kind: str = "decode"):
        """fn() in a generation thread, during a turn. Cancelled, it still waits for fn to return (a forward
        pass cannot be interrupted), so whoever cleans up afterwards never races the step. `newcomer`: the
        prompt positions of a request taking its first turn (`newcomer_shorter_than` tells a running prefill);
        `kind`: what the step is (TURN_KINDS), for `busy_seconds`."""
        ticket = object()
        if newcomer is not None:
            with self._newcomers_lock:
                self._newcomers[ticket] = newcomer
        try:
            await self.__aenter__()
        finally:
            with self._newcomers_lock:
                self._newcomers.pop(ticket, None)
        try:
            return await self.call(fn, kind)
        finally:
            self._release()

    def newcomer_shorter_than(self, positions: int) -> bool:
        """Whether a request waiting for its first turn has a prompt shorter than `positions` (what a running
        prefill still has to run): that prefill then stops its chunk for it (the answer True is counted as
        such a stop). Called from the generation threads, between the layers of a chunk."""
        with self._newcomers_lock:
            shorter = any(n < positions for n in self._newcomers.values())
            self.chunk_stops += shorter
        return shorter

    async def call(self, fn, kind: str = "decode"):
        """fn() in a generation thread, within a turn the caller holds (`async with turns`); its time counts
        as `kind`'s."""
        if kind not in self._busy:
            raise ValueError(f"a turn is one of {', '.join(TURN_KINDS)}, not {kind!r}")

        def timed():
            started = time.perf_counter()
            try:
                return fn()
            finally:
                with self._busy_lock:
                    self._busy[kind] += time.perf_counter() - started
        return await anyio.to_thread.run_sync(lambda: self._threads.submit(timed).result())

    def busy_seconds(self) -> dict[str, float]:
        """Seconds spent in steps so far, by kind (a copy)."""
        with self._busy_lock:
            return dict(self._busy)

    async def __aenter__(self) -> None:
        if self._free and not self._waiting:
            self._free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()          # granted just as it was cancelled: pass the slot on
            else:
                self._waiting.remove(turn)
            raise

    async def __aexit__(self, *exc) -> None:
        self._release()

    def _release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1

    @property
    def waiting(self) -> int:
        return len(self._waiting)


class BatchTurns:
    """Steps the replies decoding in a DecodeBatch (engine/model/batch.py) together: one batch step per turn of
    `turns` (so prefill chunks and unbatched requests keep their places in line beside it), every row each step,
    so no row waits on another. Each reply's text goes to its own queue, which its response reads: a slow client
    holds up no one, and a client that goes away leaves the batch at the end of the step running (if any), not
    at its next turn. Touched from the event loop only."""

    def __init__(self, batch, turns: FairTurns):
        self.batch = batch
        self._turns = turns
        self._queues: dict[CompletionRun, asyncio.Queue] = {}
        self._stepping: set[CompletionRun] = set()
        self._leaving: set[CompletionRun] = set()
        self._task: asyncio.Task | None = None

    def adopt(self, run: CompletionRun) -> asyncio.Queue:
        """The queue of `run`'s text pieces (then `END`, or the exception its step raised); from now on the batch
        steps it."""
        queue = self._queues.get(run)
        if queue is None:
            queue = self._queues[run] = asyncio.Queue()
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._steps())
        return queue

    def release(self, run: CompletionRun) -> bool:
        """`run`'s response is done with it: True when it may be closed now, False when it is in the step
        running now (it is closed, and its row freed, as that step ends)."""
        if run in self._stepping:
            self._leaving.add(run)
            return False
        self._queues.pop(run, None)
        return True

    async def _steps(self) -> None:
        while self._queues:
            async with self._turns:
                runs = list(self._queues)
                self._stepping = set(runs)
                try:
                    results = await self._turns.call(lambda: self.batch.step({r.row: r.step for r in runs}),
                                                     "batched decode")
                except Exception as exc:       # every reply of the step ends with it (none waits forever)
                    log.exception("a batched decode step failed")
                    results = {r.row: exc for r in runs}
                finally:
                    self._stepping = set()
            for run in runs:
                queue = self._queues.get(run)
                result = results[run.row]
                if run in self._leaving or queue is None:
                    self._queues.pop(run, None)
                    run.close()
                    continue
                if isinstance(result, BaseException):
                    queue.put_nowait(result)
                elif result:
                    queue.put_nowait(result)
                if run.finished or isinstance(result, BaseException):
                    self._queues.pop(run)
                    run.close()                 # frees its row now; the response takes the same result
                    queue.put_nowait(END)
            self._leaving.clear()


END = object()      # a BatchTurns queue's last item


# ----------------------------------------------------------------------------------------------- requests
class _Lenient(BaseModel):
    # Clients send fields this server has no use for (user, metadata, store…): they are ignored. The ones that
    # would change the answer and are not supported are refused by name below. Strict, as the OpenAI API: "3",
    # true and 2.0 are not an integer, "0" is not a number, "yes" is not a boolean.
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingRequest(_Lenient):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # Extensions, as llama.cpp's server names them.
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    top_logprobs: Any = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


def _sampling(req: _SamplingRequest, context_limit: int, prompt_tokens: int) -> tuple[SamplingSettings, tuple]:
    """SamplingSettings and stop strings from the request's OpenAI-named fields; ApiError names a bad one."""
    if req.n not in (None, 1):
        raise ApiError(400, f"n={req.n}: this server returns one choice per request (send n=1 or leave it out)", "n")
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported by this server", "logit_bias")
    name, limit = ("max_completion_tokens", req.max_completion_tokens) if req.max_completion_tokens is not None \
        else ("max_tokens", req.max_tokens)
    if limit is not None and not 1 <= limit <= context_limit:
        raise ApiError(400, f"{name} must be between 1 and the model's context of {context_limit} tokens, "
                            f"not {limit}", name)
    # Without a limit the reply may run to the end of the context (as the OpenAI API does).
    max_tokens = limit if limit is not None else max(1, context_limit - prompt_tokens)
    temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be between 0 and 2, not {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 <= top_p <= 1.0:
        raise ApiError(400, f"top_p must be between 0 and 1, not {top_p}", "top_p")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        stops = list(checked_stop_strings(stops))   # the limit every front-end shares
    except ValueError as exc:
        raise ApiError(400, str(exc), "stop") from None
    seed = None if req.seed is None else req.seed % 2 ** 64      # any integer, as the OpenAI API takes
    fields = dict(max_tokens=max_tokens, temperature=float(temperature),
                  top_p=max(float(top_p), 1e-9),                  # 0: only the most likely token survives
                  seed=seed)
    for name, value in (("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty),
                        ("top_k", req.top_k), ("min_p", req.min_p), ("repeat_penalty", req.repeat_penalty)):
        if value is not None:
            fields[name] = value
    try:
        return SamplingSettings(**fields), tuple(stops)
    except ValueError as exc:
        param = next((n for n in fields if n.replace("_", " ") in str(exc) or n.replace("_", "-") in str(exc)),
                     None)
        raise ApiError(400, str(exc), param) from None


def requested_logprobs(req: _SamplingRequest) -> int | None:
    """How many top alternatives a request wants beside each token's log probability (None: no logprobs). Chat
    completions take `logprobs: bool` and `top_logprobs` 0..20 (which needs logprobs); text completions take
    `logprobs` 0..20, the number of alternatives (0: the sampled token's only)."""
    def count(value, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"{name} must be an integer between 0 and {MAX_TOP_LOGPROBS}, not {value!r}", name)
        return value

    if isinstance(req, ChatCompletionRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise ApiError(400, f"logprobs must be true or false, not {req.logprobs!r}", "logprobs")
        top = None if req.top_logprobs is None else count(req.top_logprobs, "top_logprobs")
        if not req.logprobs:
            if top:
                raise ApiError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
            return None
        return top or 0
    if req.logprobs is None or req.logprobs is False:
        return None
    return count(req.logprobs, "logprobs")


def _token_doc(tokenizer, token_id: int, logprob: float) -> dict:
    raw = tokenizer.piece_bytes(token_id, special=True)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(entries: list, tokenizer) -> dict:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}],
    "refusal": null}, one entry per reply token (`entries`: CompletionRun.logprobs items)."""
    content = [{**_token_doc(tokenizer, lp.token_id, lp.logprob),
                "top_logprobs": [_token_doc(tokenizer, i, p) for i, p in lp.top]} for lp, _ in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list, tokenizer) -> dict:
    """A text completion choice's `logprobs`: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a dict
    token -> logprob of the most likely tokens and the sampled one, as the API says "up to logprobs + 1") and
    `text_offset` (each token's offset in the completion text)."""
    text = lambda i: tokenizer.piece_bytes(i, special=True).decode("utf-8", errors="replace")   # noqa: E731
    tops = []
    for lp, _ in entries:
        top = {text(i): p for i, p in lp.top}
        top.setdefault(text(lp.token_id), lp.logprob)
        tops.append(top)
    return {"tokens": [text(lp.token_id) for lp, _ in entries],
            "token_logprobs": [lp.logprob for lp, _ in entries],
            "top_logprobs": tops, "text_offset": [offset for _, offset in entries]}


def _chat_messages(messages: list[ChatMessage]) -> list[dict]:
    if not messages:
        raise ApiError(400, "messages is empty: send at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise ApiError(400, f"messages[{i}].role {m.role!r} is not supported: this server takes "
                                "system, developer, user and assistant messages", f"messages[{i}].role")
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content[{j}] is a {part.type!r} part: this model takes "
                                        "text only", f"messages[{i}].content")
                parts.append(part.text)
            content = "".join(parts)
        elif m.content is None:
            if role != "assistant":
                raise ApiError(400, f"messages[{i}].content is missing", f"messages[{i}].content")
            content = ""
        else:
            content = m.content
        out.append({"role": role, "content": content})
    return out


# ----------------------------------------------------------------------------------------------- routes
def openai_router(engine, turns: FairTurns | None = None, max_completions: int = DEFAULT_MAX_COMPLETIONS,
                  preparation: RequestPreparation | None = None, max_body: int | None = None,
                  batch=None) -> APIRouter:
    """The OpenAI-compatible routes over `engine` (a LarqlEngine), taking generation turns from `turns`; at most
    `max_completions` requests hold a session at once (each has a KV cache), more get a 429 (clients retry).
    Bodies are read up to what the model's context can use (and `max_body`), and prepared in `preparation`.
    With `batch` (a DecodeBatch), replies whose FFN it computes decode together once their prompts have run."""
    router = APIRouter(tags=["OpenAI-compatible"])
    turns = turns if turns is not None else FairTurns()
    preparation = preparation if preparation is not None else RequestPreparation()
    active: set[CompletionRun] = set()      # touched from the event loop only
    batch_turns = BatchTurns(batch, turns) if batch is not None else None
    model = engine.model
    model_id = model.name
    created = int(model.path.stat().st_mtime) if model.path.exists() else 0
    largest_body = body_limit(model, max_body if max_body is not None else 2 ** 62)

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "larql-desktop",
                "larql": {"chat": model.is_chat, "context_length": model.context_limit,
                          "architecture": model.config.arch, "checksum": model.checksum}}

    @router.get("/v1/models")
    def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{name:path}")
    def get_model(name: str):
        if name != model_id:
            return ApiError(404, f"the model {name!r} does not exist; this server serves {model_id!r}",
                            "model", "model_not_found").response()
        return model_card()

    async def receive(request: Request) -> bytes:
        try:
            return await read_body(request, largest_body)
        except HTTPException as exc:            # the Guard's body cap, while the body streamed in
            raise ApiError(exc.status_code, str(exc.detail)) from None

    def parse(raw: bytes, schema: type[BaseModel], check_doc=None):
        """In a preparation thread: the body as a request of `schema` (ApiError says what is wrong)."""
        preparation.stage("parse")
        doc = decode_json(raw)
        if check_doc is not None:
            check_doc(doc)
        try:
            req = schema.model_validate(doc)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if req.model != model_id:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {model_id!r}",
                           "model", "model_not_found")
        return req

    def too_long(exc: Exception, param: str) -> ApiError:
        return ApiError(400, f"{exc}: shorten it", param, "context_length_exceeded")

    def prepare_chat(raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        """In a preparation thread: the checked request and its prompt's token ids."""
        req = parse(raw, ChatCompletionRequest, refuse_unsupported_chat_fields)
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(400, "only text responses are supported", "response_format")
        messages = _chat_messages(req.messages)
        if not model.is_chat:
            raise ApiError(400, f"{model_id} is a base model without a chat template: send its prompt to "
                                "/v1/completions instead", "model", "model_not_chat")
        preparation.stage("tokenise")
        try:
            return req, model.encode_prompt(messages, max_tokens=model.context_limit)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "messages") from None
        except TextTooLong as exc:
            raise too_long(exc, "messages") from None

    def prepare_completion(raw: bytes) -> tuple[CompletionRequest, list[int]]:
        req = parse(raw, CompletionRequest)
        if req.echo:
            raise ApiError(400, "echo is not supported by this server", "echo")
        if req.suffix:
            raise ApiError(400, "suffix (insertion) is not supported by this server", "suffix")
        if req.best_of not in (None, 1):
            raise ApiError(400, "best_of must be 1 on this server", "best_of")
        preparation.stage("tokenise")
        return req, prompt_ids(req.prompt)

    def start(ids: list[int], req: _SamplingRequest, param: str) -> CompletionRun:
        settings, stops = _sampling(req, model.context_limit, len(ids))
        if len(active) >= max_completions:
            raise ApiError(429, f"the server is busy with {len(active)} completions; retry shortly",
                           code="too_many_completions")
        try:
            run = CompletionRun(engine, ids, settings, stops, requested_logprobs(req), batch,
                                pause=turns.newcomer_shorter_than)
        except PromptTooLong as exc:
            raise too_long(exc, param) from None
        except ValueError as exc:
            raise ApiError(400, str(exc), param) from None
        active.add(run)
        return run

    def finish(run: CompletionRun):
        """Close the run (idempotent) and free its place; None when it is in the batch step running now (the
        batch closes it as the step ends)."""
        active.discard(run)
        if batch_turns is not None and not batch_turns.release(run):
            return None
        return run.close()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            raw = await receive(request)
            req, ids = await preparation.run(lambda: prepare_chat(raw))
            run = start(ids, req, "messages")
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            return JSONResponse(error_doc(400, "the client went away"), status_code=400)
        return await respond(request, run, req, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request):
        try:
            raw = await receive(request)
            req, ids = await preparation.run(lambda: prepare_completion(raw))
            run = start(ids, req, "prompt")
        except ApiError as exc:
            return exc.response()
        except ClientDisconnect:
            return JSONResponse(error_doc(400, "the client went away"), status_code=400)
        return await respond(request, run, req, chat=False)

    def prompt_ids(prompt) -> list[int]:
        """A completion prompt: text, or token ids; a list of several prompts (a batch) is refused."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "send one prompt per request (a list of several is a batch, not supported)",
                               "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            vocab = model.config.vocab_size
            if not prompt or any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be 1 or more ids in 0..{vocab - 1}", "prompt")
            return list(prompt)
        try:
            ids = model.tokenizer.encode(prompt, max_tokens=model.context_limit)
        except TextTooLong as exc:
            raise too_long(exc, "prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return ids

    async def generate(run: CompletionRun, request: Request, watch_disconnect: bool) -> AsyncIterator[str]:
        """The reply's text pieces, one forward pass per turn; the run is closed however this ends."""
        try:
            while not run.finished:
                if watch_disconnect and await request.is_disconnected():
                    return
                if run.row is not None and batch_turns is not None:    # its steps are the batch's now
                    queue = batch_turns.adopt(run)
                    while True:
                        if watch_disconnect and await request.is_disconnected():
                            return
                        item = await queue.get()
                        if item is END:
                            return
                        if isinstance(item, BaseException):
                            raise item
                        yield item
                text = await turns.run(run.step, newcomer=None if run.started else run.prompt_tokens,
                                       kind="prefill" if run.prefilling else "decode")
                if text:
                    yield text
        finally:
            finish(run)

    async def respond(request: Request, run: CompletionRun, req: _SamplingRequest, chat: bool):
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        stamp = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not req.stream:
            try:
                async for _ in generate(run, request, watch_disconnect=True):
                    pass
            except Exception:
                log.exception("completion failed")
                return JSONResponse(error_doc(500, "the engine failed while generating (details in the log)"),
                                    status_code=500)
            result = finish(run)
            if result is None:       # the client went away while its reply's batch step ran
                return JSONResponse(error_doc(400, "the client went away"), status_code=400)
            choice = {"index": 0, "finish_reason": result.finish_reason,
                      "logprobs": logprobs_doc(run.take_logprobs(), chat) if run.wants_logprobs else None}
            choice.update({"message": {"role": "assistant", "content": result.text}} if chat else
                          {"text": result.text})
            return {"id": ident, "object": kind, "created": stamp, "model": model_id, "choices": [choice],
                    "usage": usage(result), "larql_cache": result.cache.to_dict()}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict | None, **extra) -> bytes:
            doc = {"id": ident, "object": chunk_kind, "created": stamp, "model": model_id,
                   "choices": [choice] if choice is not None else [], **extra}
            return f"data: {json.dumps(doc)}\n\n".encode()

        def piece(text: str | None, finish: str | None, first: bool = False) -> dict:
            # The logprobs of the tokens since the last chunk (a token whose text is held back, part of a UTF-8
            # character or of a possible stop string, goes with the chunk that carries its text).
            taken = run.take_logprobs() if run.wants_logprobs and not first else None
            logprobs = logprobs_doc(taken, chat) if taken else None
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}

        async def events() -> AsyncIterator[bytes]:
            if chat:
                yield chunk(piece(None, None, first=True))
            try:
                async for text in generate(run, request, watch_disconnect=False):
                    yield chunk(piece(text, None))
            except Exception:
                log.exception("completion failed")
                yield f"data: {json.dumps(error_doc(500, 'the engine failed while generating'))}\n\n".encode()
                yield b"data: [DONE]\n\n"
                return
            result = finish(run)
            cache = result.cache.to_dict()
            yield chunk(piece(None, result.finish_reason), usage=usage(result), larql_cache=cache)
            if include_usage:
                yield chunk(None, usage=usage(result), larql_cache=cache)
            yield b"data: [DONE]\n\n"

        return _ClosingStream(events(), lambda: finish(run), media_type="text/event-stream",
                              headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    def logprobs_doc(entries: list, chat: bool) -> dict:
        return chat_logprobs(entries, model.tokenizer) if chat else completion_logprobs(entries, model.tokenizer)

    def usage(result) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}

    return router


class _ClosingStream(StreamingResponse):
    """A streamed reply whose run is closed however the response ends: finished, failed, or cancelled when the
    client disconnects (Starlette then cancels the stream between chunks, where its generator is not closed)."""

    def __init__(self, content, finish, **kw):
        super().__init__(content, **kw)
        self._finish = finish

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._finish()
