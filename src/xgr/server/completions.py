"""The OpenAI-style completions endpoint's prompt parsing and response building."""

from __future__ import annotations

import time
import uuid
from typing import Any

from xgr.core import RecommendResult, XgrError
from xgr.server.schemas import (
    MAX_PROMPTS,
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Logprobs,
    Usage,
)


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompt field as a list of prompts (each text or token ids).

    OpenAI accepts a string, a list of token ids, or a list of either.

    Raises:
        XgrError: an empty prompt, an empty list, or more than MAX_PROMPTS prompts.
    """
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise XgrError("prompt: an empty list holds no prompt")
    if len(prompts) > MAX_PROMPTS:
        raise XgrError(f"prompt: {len(prompts)} prompts in one request, at most {MAX_PROMPTS}")
    for i, p in enumerate(prompts):
        if not p or (isinstance(p, str) and not p.strip()):
            raise XgrError(f"prompt {i} is empty")
    return prompts


def completion_response(
    engine: Any, results: list[RecommendResult], n: int, created: int, logprobs: bool = False
) -> CompletionResponse:
    """Choices for each prompt's results: ``index`` = prompt index * n + rank (OpenAI's
    numbering; a prompt with fewer than n valid semantic IDs leaves its last indexes unused).
    With ``logprobs`` each choice carries its code tokens' log-probabilities."""
    catalog = engine.served_catalog(results[0].catalog if results else None).catalog
    choices, prompt_tokens, generated = [], 0, 0
    for prompt_index, result in enumerate(results):
        prompt_tokens += result.prompt_tokens
        items = items_by_semantic_id(result)
        for rank, (codes, score) in enumerate(result.semantic_ids):
            text = catalog.format_semantic_id(codes)
            choices.append(
                CompletionChoice(
                    index=prompt_index * n + rank,
                    text=text,
                    item_ids=items.get(tuple(codes), []),
                    score=score,
                    logprobs=code_logprobs(catalog, codes, result.level_scores[rank])
                    if logprobs
                    else None,
                    finish_reason="length",
                    catalog_version=result.catalog_version,
                )
            )
            generated += catalog.num_levels
    return CompletionResponse(
        catalog=catalog_name(engine, results),
        catalog_version=min((r.catalog_version for r in results), default=1),
        id=f"cmpl-{uuid.uuid4().hex}",
        created=created or int(time.time()),
        model=engine.name,
        choices=choices,
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=generated,
            total_tokens=prompt_tokens + generated,
        ),
    )


def items_by_semantic_id(result: RecommendResult) -> dict[tuple[int, ...], list[str]]:
    """The item ids of each of a result's semantic IDs, from the catalog version its search
    ran on (the current one may have dropped them since)."""
    items: dict[tuple[int, ...], list[str]] = {}
    for item in result.items:
        items.setdefault(tuple(item.semantic_id), []).append(item.item_id)
    return items


def catalog_name(engine: Any, results: list[RecommendResult]) -> str:
    """The catalog that results came from (the default for none)."""
    return results[0].catalog if results else engine.default_catalog


def code_logprobs(
    catalog: Any, codes: tuple[int, ...], level_scores: tuple[float, ...]
) -> Logprobs:
    """OpenAI's logprobs object for one semantic ID: each code token, its log-probability
    (``RecommendResult.level_scores``) and its character offset in the choice's text."""
    tokens = [f"<{name}_{code}>" for name, code in zip(catalog.level_names, codes, strict=True)]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return Logprobs(tokens=tokens, token_logprobs=list(level_scores), text_offset=offsets)


def chat_response(engine: Any, result: RecommendResult, created: int) -> ChatCompletionResponse:
    """The chat completion of one conversation's results: a choice per semantic ID, its
    tokens as the assistant message's content, with its items and score."""
    catalog = engine.served_catalog(result.catalog).catalog
    items = items_by_semantic_id(result)
    choices = [
        ChatChoice(
            index=rank,
            message=ChatChoiceMessage(content=catalog.format_semantic_id(codes)),
            item_ids=items.get(tuple(codes), []),
            score=score,
            finish_reason="length",
        )
        for rank, (codes, score) in enumerate(result.semantic_ids)
    ]
    generated = catalog.num_levels * len(choices)
    return ChatCompletionResponse(
        catalog=result.catalog,
        catalog_version=result.catalog_version,
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=created or int(time.time()),
        model=engine.name,
        choices=choices,
        usage=Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=generated,
            total_tokens=result.prompt_tokens + generated,
        ),
    )
