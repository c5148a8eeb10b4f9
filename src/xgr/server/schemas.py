"""Request and response bodies of the HTTP API (pydantic); limits are the schema's bounds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from xgr.core import MAX_BEAM_WIDTH

# Hard limits of the schema (and the engine's beam width); a server may be configured
# tighter (ServerConfig).
MAX_HISTORY_ITEMS = 10_000
# Items of one allow-list or exclusion list in a request.
MAX_RULE_ITEMS = 100_000
MAX_PROMPTS = 256


def catalog_field() -> Any:
    """A request's ``catalog``: the name of the catalog to search."""
    return Field(
        None,
        max_length=64,
        description="The catalog to recommend from, by name (GET /v1/models lists them); "
        "default: the server's first.",
    )


class EmbedSpan(BaseModel):
    """Input embeddings for ``shape[0]`` prompt positions from ``offset`` on: the
    little-endian bytes of a row-major (n, d) array, base64."""

    model_config = ConfigDict(extra="forbid", strict=True)

    offset: int = Field(ge=0, description="First prompt position the rows replace.")
    shape: list[StrictInt] = Field(
        min_length=2, max_length=2, description="[n, d]: rows, and the model's hidden size."
    )
    dtype: Literal["float32", "bfloat16", "float16"]
    data: str = Field(description="base64 of the little-endian array bytes.")

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: list[int]) -> list[int]:
        if min(shape) < 1:
            raise ValueError("shape needs at least one row and one column")
        return shape


class RecommendRequest(BaseModel):
    """Body of ``POST /v1/recommend``."""

    # Strict: no silent coercion ("beam_width": true is not 1, [true] is not item "1").
    model_config = ConfigDict(extra="forbid", strict=True)

    history: list[StrictStr | StrictInt] = Field(
        min_length=1,
        max_length=MAX_HISTORY_ITEMS,
        description="The user's items, oldest first: item ids (strings or integers), or "
        "semantic IDs like '<a_1><b_2><c_3>'.",
    )
    beam_width: int = Field(64, ge=1, le=MAX_BEAM_WIDTH, description="Beams per decode step.")
    top_k: int | None = Field(
        None, ge=1, le=MAX_BEAM_WIDTH, description="Candidates per beam; default beam_width."
    )
    num_results: int = Field(
        10, ge=1, le=MAX_BEAM_WIDTH, description="Semantic IDs returned (<= beam_width)."
    )
    exclude_history: bool = Field(True, description="Leave the history's items out.")
    catalog: str | None = catalog_field()
    exclude_items: list[StrictStr | StrictInt] | None = Field(
        None, max_length=MAX_RULE_ITEMS, description="Item ids never returned."
    )
    allow_items: list[StrictStr | StrictInt] | None = Field(
        None, max_length=MAX_RULE_ITEMS, description="The only item ids that may be returned."
    )
    filter: dict[str, Any] | None = Field(
        None,
        description="Conditions on the catalog's item attributes, combined by AND: a value "
        '(equality), or {"in": [...]}, {"not_in": [...]}, {"lt"|"le"|"gt"|"ge": number}.',
    )
    truncate_history: bool = Field(
        False, description="Drop the oldest items when the prompt is too long (else 413)."
    )
    return_level_scores: bool = Field(
        False, description="Give each item the log-probability of each level's code."
    )
    prompt_embeds: list[EmbedSpan] | None = Field(
        None,
        description="Input embeddings over positions of the prompt built from the history "
        "(offsets count its tokens; not with truncate_history).",
    )
    deadline_ms: float | None = Field(
        None,
        allow_inf_nan=False,
        gt=0,
        le=3_600_000,
        description="Time by which the answer is wanted (ms): 504 at once when the requests "
        "waiting ahead would take longer, or when it passes before the request's batch starts.",
    )
    request_id: str | None = Field(None, max_length=128)


class RecommendedItem(BaseModel):
    item_id: str
    score: float = Field(description="Summed log-probability of the item's semantic ID.")
    semantic_id: str
    title: str | None = None
    level_scores: list[float] | None = Field(
        None,
        description="Log-probability of each level's code (they sum to score); only with "
        "return_level_scores.",
    )


class Timings(BaseModel):
    """Milliseconds the request spent in each phase (prefill/decode: its batch's)."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float


class RecommendResponse(BaseModel):
    request_id: str
    model: str
    items: list[RecommendedItem]
    complete: bool = Field(
        description="False when the search found fewer than num_results semantic IDs with "
        "an item passing the request's rules and exclusions (fewer of them exist)."
    )
    catalog: str = Field(description="The catalog searched.")
    catalog_version: int = Field(1, description="The catalog version the search ran on.")
    timings: Timings


Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(BaseModel):
    """Body of ``POST /v1/completions`` (the OpenAI shape; decoding is always beam search)."""

    # Strict: no silent coercion ("beam_width": true is not 1, [true] is not item "1").
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Prompt | None = Field(
        None,
        description="Text with semantic-ID tokens, token ids, or a list of several prompts of "
        "one kind (all texts or all token-id lists); may be left out with prompt_embeds.",
    )
    prompt_embeds: list[EmbedSpan] | None = Field(
        None,
        description="Input embeddings over positions of the one prompt (its token ids there "
        "are placeholders); without a prompt, one span at offset 0 that is the whole prompt.",
    )
    model: str | None = Field(None, max_length=256)
    n: int = Field(1, ge=1, le=MAX_BEAM_WIDTH, description="Results per prompt.")
    beam_width: int | None = Field(
        None, ge=1, le=MAX_BEAM_WIDTH, description="Beams per step; default the server's."
    )
    best_of: int | None = Field(None, ge=1, le=MAX_BEAM_WIDTH, description="Alias of beam_width.")
    use_beam_search: bool = Field(True, description="Must be true: xgr only beam-searches.")
    max_tokens: int | None = Field(
        None, ge=1, le=64, description="Must equal the number of semantic-ID levels."
    )
    temperature: float | None = Field(
        None, allow_inf_nan=False, ge=0, le=2, description="Ignored (beam search)."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        description="0: each choice carries the log-probability of each of its code tokens "
        "(OpenAI's logprobs object; the alternatives, top_logprobs, are not computed).",
    )
    user: str | None = Field(None, max_length=256)
    catalog: str | None = catalog_field()


class Logprobs(BaseModel):
    """OpenAI's completion logprobs: one entry per generated (code) token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str = Field(description="The semantic-ID tokens, e.g. '<a_1><b_2><c_3>'.")
    item_ids: list[str]
    score: float
    logprobs: Logprobs | None = None
    finish_reason: Literal["length"]
    catalog_version: int = Field(
        1, description="The catalog version this choice's prompt was searched on."
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    catalog: str
    catalog_version: int = Field(
        1,
        description="The catalog version searched; the lowest of the choices' where the "
        "prompts ran in batches on different versions (an update in between).",
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: str = Field(max_length=64, description="system, user, assistant, ...")
    content: str


class ChatCompletionRequest(BaseModel):
    """Body of ``POST /v1/chat/completions`` (the OpenAI shape; decoding is beam search over
    the catalog, the messages formatted by the model folder's chat template)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    model: str | None = Field(None, max_length=256)
    n: int = Field(1, ge=1, le=MAX_BEAM_WIDTH, description="Results.")
    beam_width: int | None = Field(
        None, ge=1, le=MAX_BEAM_WIDTH, description="Beams per step; default the server's."
    )
    top_k: int | None = Field(
        None, ge=1, le=MAX_BEAM_WIDTH, description="Candidates per beam; default beam_width."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=64, description="Must equal the number of semantic-ID levels."
    )
    temperature: float | None = Field(
        None, allow_inf_nan=False, ge=0, le=2, description="Ignored (beam search)."
    )
    user: str | None = Field(None, max_length=256)
    catalog: str | None = catalog_field()


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = Field(description="The semantic-ID tokens, e.g. '<a_1><b_2><c_3>'.")


class ChatChoice(BaseModel):
    index: int
    message: ChatChoiceMessage
    item_ids: list[str]
    score: float
    finish_reason: Literal["length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    catalog: str
    catalog_version: int = 1


class CatalogUpdateRequest(BaseModel):
    """Body of ``POST /v1/catalog``: any of add, remove and set_attributes, or replace."""

    model_config = ConfigDict(extra="forbid", strict=True)

    add: dict[str, list[str] | str] | None = Field(
        None, description='Item id -> semantic ID, ["<a_1>", "<b_2>", "<c_3>"] (new items).'
    )
    remove: list[str] | None = Field(None, description="Ids of items to remove.")
    set_attributes: dict[str, dict[str, Any]] | None = Field(
        None, description="Item id -> {attribute: value, or null for none}."
    )
    replace: dict[str, list[str] | str] | None = Field(
        None, description="A whole catalog in the index format (item id -> semantic ID)."
    )


class CatalogSummary(BaseModel):
    catalog: str = Field(description="The catalog's name.")
    catalog_version: int
    num_items: int
    num_semantic_ids: int
    fingerprint: str | None = Field(
        description="Digest of the item -> semantic ID map (GET; null in the answers of "
        "updates and rollbacks, which it would hold up by a second per million items)."
    )
    attributes: dict[str, str]


class CatalogCard(BaseModel):
    name: str
    catalog_version: int
    num_items: int
    num_semantic_ids: int
    attributes: dict[str, str] = Field(
        description="The item attributes that filters may name, with their types."
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "xgr"
    num_items: int
    num_semantic_ids: int
    num_levels: int
    max_prompt_tokens: int
    attributes: dict[str, str] = Field(
        default_factory=dict,
        description="The item attributes that filters may name, with their types (string, "
        "int, float, bool).",
    )
    catalogs: list[CatalogCard] = Field(
        default_factory=list,
        description="The catalogs served, the default first (num_items, num_semantic_ids and "
        "attributes above are the default's).",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StatusResponse(BaseModel):
    """Body of /health and /ready: "ok", "ready", "starting", or "failed" with the error."""

    status: str
    error: str | None = None


class ErrorResponse(BaseModel):
    """Body of every error answer: what was wrong and where."""

    error: str
    detail: list[dict] | None = None
