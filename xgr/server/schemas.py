"""Request and response bodies of the HTTP API (pydantic)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_HISTORY_ITEMS = 10_000
MAX_BEAM_WIDTH = 1024


class RecommendRequest(BaseModel):
    """Body of ``POST /v1/recommend``."""

    model_config = ConfigDict(extra="forbid")

    history: list[str | int] = Field(
        ...,
        min_length=1,
        max_length=MAX_HISTORY_ITEMS,
        description="The user's items, oldest first: item ids, or semantic IDs like "
        "'<a_1><b_2><c_3>'.",
    )
    beam_width: int = Field(64, ge=1, le=MAX_BEAM_WIDTH, description="Beams per decode step.")
    top_k: int | None = Field(
        None, ge=1, le=MAX_BEAM_WIDTH, description="Candidates per beam; default beam_width."
    )
    num_results: int = Field(10, ge=1, le=MAX_BEAM_WIDTH, description="Semantic IDs returned.")
    exclude_history: bool = Field(True, description="Leave the history's items out.")
    request_id: str | None = Field(None, max_length=128)


class RecommendedItem(BaseModel):
    item_id: str
    score: float = Field(description="Summed log-probability of the item's semantic ID.")
    semantic_id: str
    title: str | None = None


class Timings(BaseModel):
    """Milliseconds spent by the request in each phase."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float


class RecommendResponse(BaseModel):
    request_id: str
    model: str
    items: list[RecommendedItem]
    timings: Timings


class HealthResponse(BaseModel):
    status: str


class ErrorResponse(BaseModel):
    """Body of every 4xx answer: what was wrong and where."""

    error: str
    detail: list[dict] | str | None = None
