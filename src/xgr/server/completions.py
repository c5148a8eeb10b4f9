"""The OpenAI-style completions endpoint's prompt parsing and response building."""

from __future__ import annotations

import time
import uuid
from typing import Any

from xgr.core import RecommendResult, XgrError
from xgr.server.schemas import MAX_PROMPTS, CompletionChoice, CompletionResponse, Usage


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
    engine: Any, results: list[RecommendResult], n: int, created: int
) -> CompletionResponse:
    """Choices for each prompt's results: ``index`` = prompt index * n + rank (OpenAI's
    numbering; a prompt with fewer than n valid semantic IDs leaves its last indexes unused)."""
    catalog = engine.catalog
    choices, prompt_tokens, generated = [], 0, 0
    for prompt_index, result in enumerate(results):
        prompt_tokens += result.prompt_tokens
        for rank, (codes, score) in enumerate(result.semantic_ids):
            sid = catalog.find_semantic_id(codes)
            choices.append(
                CompletionChoice(
                    index=prompt_index * n + rank,
                    text=catalog.format_semantic_id(codes),
                    item_ids=catalog.items_of_semantic_id(sid),
                    score=score,
                    finish_reason="length",
                )
            )
            generated += catalog.num_levels
    return CompletionResponse(
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
