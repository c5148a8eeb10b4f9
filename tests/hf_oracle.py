"""HF transformers' constrained beam search: the correctness oracle of xgr's engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xgr import ItemCatalog


def catalog_constraint(catalog: ItemCatalog, sid_map: np.ndarray):
    """``allowed(generated)``: the token ids that may follow a generated token prefix.

    Prefixes that are no catalog path (held by HF's filler beams, score -1e9 or -inf) may be
    followed by any code of the next level.
    """
    levels = catalog.num_levels
    allowed: dict[tuple[int, ...], set[int]] = {}
    for row in catalog.semantic_ids.tolist():
        tokens = [int(sid_map[level, code]) for level, code in enumerate(row)]
        for depth in range(levels):
            allowed.setdefault(tuple(tokens[:depth]), set()).add(tokens[depth])
    any_code = {d: sorted({int(t) for t in sid_map[d] if t >= 0}) for d in range(levels)}

    def allowed_after(generated: tuple[int, ...]) -> list[int]:
        return sorted(allowed.get(generated, any_code[len(generated)]))

    return allowed_after


def _results(sequences, scores, skip: int, sid_map: np.ndarray):
    """[(codes, score)] of generate's sequences (first ``skip`` tokens dropped), best first,
    filler beams (score <= -1e8, left when fewer valid paths than beams exist) dropped."""
    levels = sid_map.shape[0]
    token_to_code = {int(sid_map[d, c]): c for d in range(levels) for c in range(sid_map.shape[1])}
    return [
        (tuple(token_to_code[t] for t in seq[skip:]), score)
        for seq, score in zip(sequences.tolist(), scores.tolist(), strict=True)
        if score > -1e8
    ]


def _constrained_generate(model, prompt, catalog, sid_map, beam_width, skip: int, **options):
    """``generate`` with the catalog trie over the generated tokens after the first ``skip``
    of each sequence; ``options`` add to the common beam-search arguments.

    Returns:
        generate's output, and its [(codes, score)] as ``_results`` gives them.
    """
    allowed_after = catalog_constraint(catalog, sid_map)

    def prefix_fn(batch_id, ids):
        return allowed_after(tuple(ids[skip:].tolist()))

    if isinstance(prompt, torch.Tensor):  # (n, hidden) input embeddings
        inputs = {"inputs_embeds": prompt[None]}
    else:
        inputs = {"input_ids": torch.tensor([prompt])}
    out = model.generate(
        **inputs,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=beam_width,
        num_return_sequences=beam_width,
        do_sample=False,
        length_penalty=0.0,
        max_new_tokens=catalog.num_levels,
        prefix_allowed_tokens_fn=prefix_fn,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        **options,
    )
    return out, _results(out.sequences, out.sequences_scores, skip, sid_map)


def hf_constrained_beam_search(
    model, prompt: list[int], catalog: ItemCatalog, sid_map: np.ndarray, beam_width: int
) -> list[tuple[tuple[int, ...], float]]:
    """``generate(num_beams=B, num_return_sequences=B, length_penalty=0, trie constraint)``.

    Returns:
        [(codes, score)] best first, HF's filler beams (score <= -1e8, left when fewer valid
        paths than beams exist) dropped.
    """
    _, results = _constrained_generate(
        model, prompt, catalog, sid_map, beam_width, len(prompt), pad_token_id=0
    )
    return results


def hf_constrained_beam_search_embeds(
    model, embeds: torch.Tensor, catalog: ItemCatalog, sid_map: np.ndarray, beam_width: int
) -> list[tuple[tuple[int, ...], float]]:
    """``hf_constrained_beam_search`` of a prompt given as its input embeddings,
    ``generate(inputs_embeds=...)`` ((n, hidden) float32): the sequences hold only the
    generated tokens."""
    _, results = _constrained_generate(
        model, embeds, catalog, sid_map, beam_width, 0, pad_token_id=0
    )
    return results


def hf_t5_constrained_beam_search(
    model, prompt, catalog: ItemCatalog, sid_map: np.ndarray, beam_width: int
) -> list[tuple[tuple[int, ...], float]]:
    """The encoder-decoder analogue of ``hf_constrained_beam_search``: the prompt (token
    ids, or an (n, d_model) tensor of the encoder's input embeddings) is the encoder input,
    the decoder output starts with the decoder start token.

    Returns:
        [(codes, score)] best first, filler beams dropped.
    """
    out, results = _constrained_generate(
        model, prompt, catalog, sid_map, beam_width, 1,
        early_stopping=True,
        # transformers 5.24's cache sizes itself by the encoder's layer count, which fails
        # for decoders with more layers; without it each step reruns the decoder (same result).
        use_cache=False,
    )  # fmt: skip
    assert (out.sequences[:, 0] == model.config.decoder_start_token_id).all()
    return results


def assert_same_semantic_ids(got, expected, atol: float = 1e-4) -> None:
    """Two [(codes, score)] lists (best first): the same codes in the same order, scores
    within ``atol``."""
    assert [codes for codes, _ in got] == [codes for codes, _ in expected]
    for (_, s_got), (_, s_exp) in zip(got, expected, strict=True):
        assert s_got == pytest.approx(s_exp, abs=atol)
