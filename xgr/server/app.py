"""The HTTP server: FastAPI routes over one ``Engine``.

Engine calls run in a worker thread, one at a time (the engine is not re-entrant), so the
event loop keeps answering health checks while a batch computes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from xgr.core import XgrError
from xgr.engine import Engine
from xgr.server.schemas import (
    ErrorResponse,
    HealthResponse,
    RecommendedItem,
    RecommendRequest,
    RecommendResponse,
    Timings,
)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the message says why)."},
    422: {"model": ErrorResponse, "description": "Body does not match the schema."},
}


def resolve_history(engine: Engine, history: list[str | int]) -> tuple[list[str], set[str]]:
    """History entries -> (item ids for the prompt, item ids to exclude).

    A semantic-ID string stands for its items: the first one (in catalog order) builds the
    prompt, and all of them are excluded.

    Raises:
        XgrError: entries that are neither catalog item ids nor catalog semantic IDs.
    """
    catalog = engine.catalog
    prompt_items: list[str] = []
    excluded: set[str] = set()
    unknown = []
    for entry in history:
        text = str(entry)
        if text in catalog.item_index:
            prompt_items.append(text)
            excluded.add(text)
        elif text.startswith("<"):
            try:
                codes = catalog.parse_semantic_id(text)
            except XgrError:
                unknown.append(text)
                continue
            items = catalog.items_of_semantic_id(catalog.find_semantic_id(codes))
            prompt_items.append(items[0])
            excluded.update(items)
        else:
            unknown.append(text)
    if unknown:
        raise XgrError(f"unknown items in history: {unknown[:20]}")
    return prompt_items, excluded


def create_app(engine: Engine, titles: dict[str, str] | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; ``titles`` (item id -> title) fill responses."""
    titles = titles or {}
    app = FastAPI(title="xgr", summary="Generative recommendation by constrained beam search")
    lock = asyncio.Lock()

    @app.exception_handler(XgrError)
    async def bad_input(_: Request, exc: XgrError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": str(exc)})

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse(
            status_code=422, content={"error": "invalid request body", "detail": errors}
        )

    @app.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        return HealthResponse(status="ok")

    @app.post("/v1/recommend", response_model=RecommendResponse, responses=ERROR_RESPONSES)
    async def recommend(body: RecommendRequest) -> RecommendResponse:
        arrived = time.perf_counter()
        items, excluded = resolve_history(engine, body.history)
        prompt = engine.history_prompt(items)
        top_k = body.top_k or body.beam_width
        async with lock:
            started = time.perf_counter()
            (result,) = await asyncio.to_thread(
                engine.recommend,
                [prompt],
                beam_width=body.beam_width,
                top_k=top_k,
                num_results=body.num_results,
                exclude_item_ids=[excluded if body.exclude_history else ()],
            )
        catalog = engine.catalog
        return RecommendResponse(
            request_id=body.request_id or uuid.uuid4().hex,
            model=engine.name,
            items=[
                RecommendedItem(
                    item_id=r.item_id,
                    score=r.score,
                    semantic_id=catalog.format_semantic_id(r.semantic_id),
                    title=titles.get(r.item_id),
                )
                for r in result.items
            ],
            timings=Timings(
                queue_ms=(started - arrived) * 1e3,
                prefill_ms=result.prefill_ms,
                decode_ms=result.decode_ms,
                total_ms=(time.perf_counter() - arrived) * 1e3,
            ),
        )

    return app
