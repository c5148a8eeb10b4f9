"""The HTTP API: FastAPI routes over one ``Engine`` through the batching queue.

Routes: ``POST /v1/recommend``, ``POST /v1/completions`` (OpenAI shape), ``GET /v1/models``,
``GET /health`` (liveness), ``GET /ready`` (200 once a warm-up generation has run),
``GET /metrics`` (Prometheus). Errors: 400 bad input, 404 unknown model, 408 body too slow,
413 body or prompt too long, 422 body not matching the schema, 429 queue full (with
Retry-After, decided before the body is read), 500 a numerical or unexpected failure, 503
shutting down or the scheduler failed, 504 deadline passed or cannot be met. A request whose
client disconnects is withdrawn from the queue; on shutdown (SIGTERM under uvicorn) admitted
requests are finished first.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from xgr.catalog import ItemCatalog, resolve_history
from xgr.catalog.attributes import compile_filter
from xgr.core import Prompt, SearchParams, XgrError
from xgr.engine import Engine
from xgr.engine.prompt import each_prompt
from xgr.scheduler import (
    QueuedRequest,
    RequestBatcher,
    ServingMetrics,
)
from xgr.server.admission import AdmissionGate, error_response
from xgr.server.completions import chat_response, completion_prompts, completion_response
from xgr.server.config import BodySizeLimit, ServerConfig
from xgr.server.embeds import decode_spans, embedded_prompt
from xgr.server.replicas import CatalogChange, Replicas
from xgr.server.schemas import (
    CatalogCard,
    CatalogSummary,
    CatalogUpdateRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    RecommendedItem,
    RecommendRequest,
    RecommendResponse,
    StatusResponse,
    Timings,
)

# The framework's one message for a body it cannot decode: not UTF-8, not JSON, or JSON past
# the parser's bounds (nesting depth, digits of an integer).
BODY_NOT_PARSED = (
    "invalid request body: not parsable JSON text (UTF-8, with bounded nesting and numbers)"
)


# How often the server's threads hand the interpreter lock to each other (s). While a
# CPU-bound thread runs (a catalog update building a million-item version), every socket
# read or queue wait of the event loop and the batch threads costs one interval to get the
# lock back: Python's 5 ms would stall serving for the whole update.
SWITCH_INTERVAL_S = 0.0001


class AdminAuthError(XgrError):
    """A catalog admin request without the admin token (401)."""


class ModelNotFoundError(XgrError):
    """A completion names a model this server does not serve (404)."""


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


POST_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("Invalid request: the message says what and where."),
    408: _error("The body did not arrive in time after its headers."),
    413: _error("Request body or prompt too long."),
    422: _error("Body does not match the schema."),
    429: _error("The queue is full; retry after the Retry-After header's seconds."),
    500: _error("The model produced no finite score, or an unexpected error (named)."),
    503: _error("Shutting down, the scheduler failed, or every connection is busy."),
    504: _error("The deadline passed, or cannot be met, before the request could start."),
}


def freeze_long_lived_objects() -> None:
    """Move every object alive now (the model, the catalog's tables, the server) out of the
    garbage collector's reach: they live as long as the process, and a full collection
    walking a million-item catalog holds the interpreter for about 100 ms, a pause that
    every request in the server then waits through."""
    gc.collect()
    gc.freeze()


@contextmanager
def built_without_collections() -> Iterator[None]:
    """Run a catalog version's build with the garbage collector off, and freeze what it
    made (as ``freeze_long_lived_objects``, without its full collection): a collection
    during the build, or later over its million new objects, would hold the interpreter
    for about 100 ms while requests wait."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


async def client_gone(request: Request) -> None:
    """Return once the client of ``request`` (whose body has been read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass  # no more body is sent once it has been read; nothing else can arrive


def create_app(
    engine: Engine,
    config: ServerConfig | None = None,
    replicas: Replicas | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: the engine (its model, catalog and titles).
        config: limits and defaults.
        replicas: where this app is one of several replicas (``xgr.server.ray_serve``):
            ``/ready`` waits for all of them, ``/metrics`` gives all of theirs, and catalog
            changes reach all of them.

    Raises:
        XgrError: the model cannot hold a prompt of one item (its warm-up request).
    """
    config = config or ServerConfig()
    metrics = ServingMetrics(engine.name)
    batcher = RequestBatcher(
        engine,
        config.max_batch_size,
        metrics,
        config.max_batch_tokens,
        config.max_queue,
        # The engine's batches in flight: its streams (config.streams) x its pipeline depth. More
        # batches in flight would only queue in threads, past the deadline checks.
        engine.max_in_flight,
        config.max_batch_ms,
    )
    state = {"ready": False, "started": int(time.time())}
    # Built now, so that a model too small for one item is refused before the server starts.
    warm_ups = [
        (name, engine.history_prompt(served.catalog.item_ids[:1], truncate=True, catalog=name))
        for name, served in engine.catalogs.items()
    ]

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        batcher.start()
        # /ready turns 200 only after one real generation: the first request pays no warm-up.
        for name, prompt in warm_ups:
            await batcher.submit(QueuedRequest(prompt, 1, 1, 1, recorded=False, catalog=name))
        for name, served in engine.catalogs.items():
            metrics.set_catalog_version(name, served.version)
        freeze_long_lived_objects()
        state["ready"] = True
        yield
        state["ready"] = False
        await batcher.stop(drain=True)  # uvicorn has stopped accepting: finish what came in
        if replicas is not None:
            replicas.stop()
        sys.setswitchinterval(switch_interval)

    app = FastAPI(
        title="xgr",
        summary="Generative recommendation by catalog-constrained beam search",
        lifespan=lifespan,
        redirect_slashes=False,  # "/v1/recommend/" is an unknown route (404), not a redirect
    )
    app.add_middleware(
        BodySizeLimit,
        max_bytes=config.max_body_bytes,
        paths={"/v1/catalog": config.max_catalog_body_bytes} if config.admin_token else None,
    )
    # Added last, so it runs first: a refused request costs no body read or parse.
    app.add_middleware(
        AdmissionGate,
        batcher=batcher,
        paths=frozenset({"/v1/recommend", "/v1/completions", "/v1/chat/completions"}),
    )

    @app.exception_handler(XgrError)
    async def bad_input(_: Request, exc: XgrError) -> JSONResponse:
        status = 404 if isinstance(exc, ModelNotFoundError) else None
        if isinstance(exc, AdminAuthError):
            response = error_response(exc, 401)
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return error_response(exc, status)

    async def answer_unless_disconnected(request: Request, waiting):
        """The awaited answer, or None once the client has gone (its requests withdrawn).

        The client's leaving is awaited as the server's ``http.disconnect`` message, not
        polled: polling every waiting request costs the event loop in proportion to the
        queue, and so the most when the server is busiest.
        """
        task = asyncio.ensure_future(waiting)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # withdrawn; nothing to report
        return None

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Same body shape as every other error (unknown route, unparsable body, ...).
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # The framework's words for a body it cannot decode (bytes that are not UTF-8):
            # as malformed JSON, a 422 that says what is wrong.
            return JSONResponse(
                status_code=422,
                content={"error": BODY_NOT_PARSED, "detail": []},
            )
        return JSONResponse(
            status_code=exc.status_code, content={"error": str(exc.detail)}, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"]} for e in exc.errors()]
        error = "invalid request body"
        if "json" not in request.headers.get("content-type", "").lower():
            # The framework then reads the body as a string ("Input should be a valid
            # dictionary"): say what it should have been.
            error += ": send JSON with content-type application/json"
        return JSONResponse(status_code=422, content={"error": error, "detail": detail})

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette sends this answer and then re-raises, so the server logs the traceback
        # and closes the connection (uvicorn does): the header tells the client beforehand.
        return JSONResponse(
            status_code=500,
            content={"error": f"internal error: {type(exc).__name__}"},
            headers={"Connection": "close"},
        )

    def check_search(beam_width: int, top_k: int, num_results: int) -> None:
        """Refuse before queueing, so one bad request never fails a shared batch."""
        if beam_width > config.max_beam_width:
            raise XgrError(
                f"beam_width {beam_width} exceeds this server's limit {config.max_beam_width}"
            )
        SearchParams(beam_width, top_k, num_results)

    def scheduler_failed() -> JSONResponse | None:
        """A 503 saying why, once the scheduling loop has failed (nothing is served)."""
        if batcher.failure is None:
            return None
        return JSONResponse(status_code=503, content={"status": "failed", "error": batcher.failure})

    @app.get(
        "/health",
        response_model=StatusResponse,
        response_model_exclude_none=True,
        responses={503: {"model": StatusResponse, "description": "The scheduler failed."}},
    )
    async def health() -> Any:
        return scheduler_failed() or StatusResponse(status="ok")

    @app.get(
        "/ready",
        response_model=StatusResponse,
        response_model_exclude_none=True,
        responses={503: {"model": StatusResponse, "description": "Warming up, or failed."}},
    )
    async def ready() -> Any:
        if failed := scheduler_failed():
            return failed
        if not state["ready"]:
            return JSONResponse(status_code=503, content={"status": "starting"})
        waiting = await asyncio.to_thread(replicas.waiting) if replicas is not None else None
        if waiting is not None:
            return JSONResponse(status_code=503, content={"status": "starting", "error": waiting})
        return StatusResponse(status="ready")

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text."}},
    )
    async def prometheus_metrics() -> Response:
        text = generate_latest(metrics.registry)
        if replicas is not None:
            text = await asyncio.to_thread(replicas.metrics, text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        catalog = engine.catalog
        card = ModelCard(
            id=engine.name,
            created=state["started"],
            num_items=len(catalog),
            num_semantic_ids=catalog.num_semantic_ids,
            num_levels=catalog.num_levels,
            max_prompt_tokens=engine.max_prompt_tokens,
            attributes=attribute_kinds(catalog),
            catalogs=[
                CatalogCard(
                    name=name,
                    catalog_version=version.version,
                    num_items=len(version.catalog),
                    num_semantic_ids=version.catalog.num_semantic_ids,
                    attributes=attribute_kinds(version.catalog),
                )  # fmt: skip
                for name, version in ((n, s.current) for n, s in engine.catalogs.items())
            ],
        )
        return ModelList(data=[card])

    @app.post("/v1/recommend", response_model=RecommendResponse, responses=POST_ERRORS)
    async def recommend(body: RecommendRequest, http_request: Request) -> Any:
        refuse_query(http_request)
        arrived = time.perf_counter()
        top_k = body.top_k or body.beam_width
        check_search(body.beam_width, top_k, body.num_results)
        deadline = arrived + body.deadline_ms / 1e3 if body.deadline_ms else None
        batcher.check_admission(1, deadline)  # before the history is resolved
        served = engine.served_catalog(body.catalog)
        if body.filter is not None:  # a 400 naming the attribute, operator or value
            compile_filter(body.filter, served.catalog.attributes)

        if body.prompt_embeds is not None and body.truncate_history:
            raise XgrError(
                "prompt_embeds name positions of the prompt built from the whole history: "
                "they cannot be combined with truncate_history"
            )

        def prepare():  # CPU work on long histories: off the event loop
            version = served.current
            history = resolve_history(version.catalog, body.history, version.title_index)
            items = history.item_ids
            prompt = engine.token_ids(
                engine.history_prompt(items, body.truncate_history, catalog=served.name)
            )
            if body.prompt_embeds is not None:
                spans = decode_spans(body.prompt_embeds, engine.max_prompt_tokens)
                prompt = checked_prompt(engine, embedded_prompt(prompt, spans))
            return history, prompt

        history, prompt = await asyncio.to_thread(prepare)
        answer = await answer_unless_disconnected(
            http_request,
            batcher.submit(
                QueuedRequest(
                    prompt,
                    body.beam_width,
                    top_k,
                    body.num_results,
                    frozenset(history.excluded if body.exclude_history else ())
                    | frozenset(str(i) for i in body.exclude_items or ()),
                    deadline,
                    arrived,
                    allow=None
                    if body.allow_items is None
                    else frozenset(str(i) for i in body.allow_items),
                    item_filter=body.filter,
                    catalog=served.name,
                )
            ),
        )
        if answer is None:  # nobody is listening
            return Response(status_code=499)
        result, times = answer.result, answer.times
        return RecommendResponse(
            request_id=body.request_id if body.request_id is not None else uuid.uuid4().hex,
            model=engine.name,
            items=[
                RecommendedItem(
                    item_id=r.item_id,
                    score=r.score,
                    title=r.title,
                    semantic_id=served.catalog.format_semantic_id(r.semantic_id),
                    level_scores=list(r.level_scores) if body.return_level_scores else None,
                )
                for r in result.items
            ],
            complete=result.complete,
            catalog=result.catalog,
            catalog_version=result.catalog_version,
            timings=Timings(
                queue_ms=times.queue * 1e3,
                prefill_ms=times.prefill * 1e3,
                decode_ms=times.decode * 1e3,
                total_ms=(time.perf_counter() - arrived) * 1e3,
            ),
        )

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**POST_ERRORS, 404: _error("Unknown model.")},
    )
    async def completions(body: CompletionRequest, http_request: Request) -> Any:
        refuse_query(http_request)
        check_model(engine, body.model)
        if not body.use_beam_search:
            raise XgrError("use_beam_search must be true: xgr decodes by beam search only")
        if body.logprobs:
            raise XgrError(
                "logprobs must be 0 or absent (got a positive value): each choice's own code "
                "tokens' log-probabilities are given, not the top alternatives"
            )
        check_max_tokens(engine, body.max_tokens)
        if body.beam_width and body.best_of and body.beam_width != body.best_of:
            raise XgrError(
                f"beam_width ({body.beam_width}) and its alias best_of ({body.best_of}) differ"
            )
        beam_width = completion_beam(
            config, body.n, body.beam_width or body.best_of, ", from beam_width or best_of"
        )
        check_search(beam_width, beam_width, body.n)
        catalog = engine.served_catalog(body.catalog).name

        if body.prompt is None and body.prompt_embeds is None:
            raise XgrError("a completion needs a prompt, prompt_embeds, or both")

        def tokenize_all() -> list[np.ndarray | Prompt]:
            if body.prompt_embeds is not None:
                ids = None
                if body.prompt is not None:
                    ids = engine.token_ids(_one_prompt(completion_prompts(body.prompt)))
                spans = decode_spans(body.prompt_embeds, engine.max_prompt_tokens)
                return [checked_prompt(engine, embedded_prompt(ids, spans))]
            return each_prompt(completion_prompts(body.prompt), engine.token_ids)

        prompts = await asyncio.to_thread(tokenize_all)
        # All prompts of one completion are admitted together (or refused together), so they
        # share a batch and a full queue never runs part of a completion.
        answers = await answer_unless_disconnected(
            http_request,
            batcher.submit_all(
                [QueuedRequest(p, beam_width, beam_width, body.n, catalog=catalog) for p in prompts]
            ),
        )
        if answers is None:  # nobody is listening
            return Response(status_code=499)

        def respond() -> bytes:  # up to 256 x 4096 choices: build and encode off the loop
            results = [a.result for a in answers]
            response = completion_response(
                engine, results, body.n, int(time.time()), logprobs=body.logprobs is not None
            )
            return response.model_dump_json().encode()

        return Response(await asyncio.to_thread(respond), media_type="application/json")

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**POST_ERRORS, 404: _error("Unknown model.")},
    )
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Any:
        refuse_query(http_request)
        check_model(engine, body.model)
        check_max_tokens(engine, body.max_tokens)
        beam_width = completion_beam(config, body.n, body.beam_width)
        top_k = body.top_k or beam_width
        check_search(beam_width, top_k, body.n)
        catalog = engine.served_catalog(body.catalog).name
        messages = [m.model_dump() for m in body.messages]
        prompt = await asyncio.to_thread(lambda: engine.token_ids(engine.chat_prompt(messages)))
        answers = await answer_unless_disconnected(
            http_request,
            batcher.submit_all([QueuedRequest(prompt, beam_width, top_k, body.n, catalog=catalog)]),
        )
        if answers is None:  # nobody is listening
            return Response(status_code=499)
        return chat_response(engine, answers[0].result, int(time.time()))

    apply = None
    if config.admin_token:
        apply = add_catalog_admin(app, engine, config.admin_token, metrics, replicas)
    if replicas is not None:
        # Before the app takes requests: the changes the replicas made before it started.
        replicas.start(apply, lambda: generate_latest(metrics.registry))
    return app


def add_catalog_admin(
    app: FastAPI,
    engine: Engine,
    token: str,
    metrics: ServingMetrics | None = None,
    replicas: Replicas | None = None,
) -> Callable[[CatalogChange], CatalogSummary]:
    """The catalog admin API (``GET``/``POST /v1/catalog``, ``POST /v1/catalog/rollback``),
    each request authorized by ``Authorization: Bearer <token>`` (compared in constant
    time; no answer echoes it). Each takes ``?catalog=NAME`` (default: the first catalog).
    A new version is reported to ``metrics`` (``xgr:catalog_version``); with ``replicas``,
    each change is applied by every replica, in one order, before it is answered.

    Returns:
        The function that applies one change here (what the replicas follow).
    """
    expected = token.encode()

    def authorize(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise AdminAuthError(
                "the catalog API needs the header Authorization: Bearer <token>, with the "
                "server's admin token"
            )

    def summary(name: str, fingerprint: bool = False) -> CatalogSummary:
        version = engine.served_catalog(name).current
        catalog = version.catalog
        if metrics is not None:
            metrics.set_catalog_version(name, version.version)
        return CatalogSummary(
            catalog=name, catalog_version=version.version, num_items=len(catalog),
            num_semantic_ids=catalog.num_semantic_ids,
            fingerprint=catalog.fingerprint if fingerprint else None,
            attributes=attribute_kinds(catalog),
        )  # fmt: skip

    admin = {401: _error("No or another admin token.")}

    updating = threading.Lock()  # one update at a time: the collector is paused for it

    def named(request: Request) -> str:
        """The catalog a request names (``?catalog=``), after its authorization.

        Raises:
            XgrError: another query parameter, or ``catalog`` given twice (a write must not
                land on the default catalog by a typo).
        """
        authorize(request)
        refuse_query(request, allowed="catalog")
        names = request.query_params.getlist("catalog")
        if len(names) > 1:
            raise XgrError(f"?catalog= is given {len(names)} times: name one catalog")
        return engine.served_catalog(names[0] if names else None).name

    @app.get("/v1/catalog", response_model=CatalogSummary, responses=admin)
    async def catalog_info(request: Request) -> Any:
        return await asyncio.to_thread(summary, named(request), True)

    def apply(change: CatalogChange) -> CatalogSummary:
        """Apply one change here (an update's body, or a rollback); the summary of the
        version it made, taken under the same lock."""
        name, body = change.catalog, change.update
        with updating, built_without_collections():
            if body is None:
                engine.rollback_catalog(name)
            else:
                replace = None
                if body.get("replace") is not None:
                    codebook = engine.served_catalog(name).catalog.codebook_size
                    replace = ItemCatalog.from_index_dict(body["replace"], codebook)
                engine.update_catalog(
                    body.get("add"), body.get("remove"), body.get("set_attributes"), replace, name
                )
            return summary(name)

    def answered(change: CatalogChange) -> CatalogSummary:
        return apply(change) if replicas is None else replicas.change(change, apply)

    @app.post("/v1/catalog", response_model=CatalogSummary, responses={**admin, **POST_ERRORS})
    async def update_catalog(body: CatalogUpdateRequest, request: Request) -> Any:
        name = named(request)
        refuse_duplicate_keys(await request.body())
        given = {key: value for key, value in body.model_dump().items() if value is not None}
        change = CatalogChange(name, given)
        return await asyncio.to_thread(answered, change)

    @app.post("/v1/catalog/rollback", response_model=CatalogSummary, responses=admin)
    async def rollback_catalog(request: Request) -> Any:
        return await asyncio.to_thread(answered, CatalogChange(named(request)))

    return apply


def refuse_query(request: Request, allowed: str | None = None) -> None:
    """Refuse query parameters other than ``allowed``: the API reads its requests' bodies,
    and a parameter it ignored (``?catalog=eu`` on a search) would silently mean another
    request.

    Raises:
        XgrError: naming the parameters (400).
    """
    extra = sorted({k for k in request.query_params if k != allowed})
    if extra:
        takes = (
            f"only ?{allowed}="
            if allowed
            else "no query parameters (its options, such as catalog, go in the JSON body)"
        )
        raise XgrError(f"{request.url.path} takes {takes}; got {', '.join(extra)[:200]}")


def refuse_duplicate_keys(body: bytes) -> None:
    """Refuse a JSON body in which an object names a key twice (the parser would keep the
    last silently: an item added twice, or two ``remove`` lists of which one is lost).

    Raises:
        XgrError: naming the key (400).
    """

    def pairs(items: list[tuple[str, Any]]) -> dict:
        found = dict(items)
        if len(found) != len(items):
            seen: set[str] = set()
            twice = next(k for k, _ in items if k in seen or seen.add(k))
            raise XgrError(f"the request body names {twice[:80]!r} twice in one object")
        return found

    try:
        json.loads(body, object_pairs_hook=pairs)
    except XgrError:
        raise
    except ValueError:
        pass  # the schema's validation has already answered malformed JSON


def attribute_kinds(catalog: ItemCatalog) -> dict[str, str]:
    """The catalog's filterable attributes and their types (none without attributes)."""
    return catalog.attributes.kinds if catalog.attributes is not None else {}


def check_model(engine: Engine, model: str | None) -> None:
    """Raise ``ModelNotFoundError`` (404) when a completion names another model."""
    if model is not None and model != engine.name:
        raise ModelNotFoundError(
            f"model {model!r} is not served here; this server serves {engine.name!r}"
        )


def check_max_tokens(engine: Engine, max_tokens: int | None) -> None:
    """Raise ``XgrError`` when ``max_tokens`` is not the number of semantic-ID levels."""
    levels = engine.catalog.num_levels
    if max_tokens is not None and max_tokens != levels:
        raise XgrError(f"max_tokens must equal the number of semantic-ID levels ({levels})")


def completion_beam(config: ServerConfig, n: int, beam_width: int | None, named: str = "") -> int:
    """A completion's beam width: the one given, else max(n, the server's default).

    Args:
        named: how the request named the width, for the error (", from ...").

    Raises:
        XgrError: no width given and n over the server's limit, or n over the width.
    """
    if not beam_width and n > config.max_beam_width:
        raise XgrError(
            f"n ({n}) exceeds this server's limit {config.max_beam_width} (n results "
            "need a beam at least as wide)"
        )
    width = beam_width or max(n, config.default_beam_width)
    if n > width:  # named as this API names them, not as the engine does
        raise XgrError(f"n ({n}) must not exceed the beam width ({width}{named})")
    return width


def _one_prompt(prompts: list) -> Any:
    """The single prompt that prompt_embeds go with.

    Raises:
        XgrError: several prompts.
    """
    if len(prompts) != 1:
        raise XgrError(f"prompt_embeds go with one prompt, got {len(prompts)}")
    return prompts[0]


def checked_prompt(engine: Engine, prompt: Prompt) -> Prompt:
    """The prompt with its token ids and spans checked and converted (the engine's
    ``prompt_input``), so that the batch's launch finds them ready.

    Raises:
        XgrError: a bad prompt or span, named.
    """
    tokens, spans = engine.prompt_input(prompt)
    return Prompt(token_ids=tokens, embeds=spans)
