"""HF transformers' constrained beam search: the correctness oracle of xgr's engine."""

from __future__ import annotations

import numpy as np
import torch

from xgr import ItemCatalog


def hf_constrained_beam_search(
    model, prompt: list[int], catalog: ItemCatalog, sid_map: np.ndarray, beam_width: int
) -> list[tuple[tuple[int, ...], float]]:
    """``generate(num_beams=B, num_return_sequences=B, length_penalty=0, trie constraint)``.

    Returns:
        [(codes, score)] best first, HF's filler beams (score <= -1e8, left when fewer valid
        paths than beams exist) dropped.
    """
    levels = catalog.num_levels
    allowed: dict[tuple[int, ...], set[int]] = {}
    for row in catalog.semantic_ids.tolist():
        tokens = [int(sid_map[level, code]) for level, code in enumerate(row)]
        for depth in range(levels):
            allowed.setdefault(tuple(tokens[:depth]), set()).add(tokens[depth])
    any_code = {d: sorted({int(t) for t in sid_map[d] if t >= 0}) for d in range(levels)}

    def prefix_fn(batch_id, input_ids):
        generated = tuple(input_ids[len(prompt) :].tolist())
        # Filler beams (score -1e9 or -inf) may hold prefixes that are no catalog path.
        return sorted(allowed.get(generated, any_code[len(generated)]))

    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=beam_width,
        num_return_sequences=beam_width,
        do_sample=False,
        length_penalty=0.0,
        max_new_tokens=levels,
        prefix_allowed_tokens_fn=prefix_fn,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    token_to_code = {int(sid_map[d, c]): c for d in range(levels) for c in range(sid_map.shape[1])}
    results = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        if score > -1e8:
            results.append((tuple(token_to_code[t] for t in seq[len(prompt) :]), score))
    return results
