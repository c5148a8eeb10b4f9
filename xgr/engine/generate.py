"""The fixed-step generation of semantic IDs for a batch of prompts (the reference path).

Steps, for R prompts, beam width B and L levels:

1. prefill: the packed prompts run once; each layer writes the shared KV; the last
   token of each prompt gives the first level's log-probabilities;
2. level 0: constrained beam step from the trie root (one beam per request -> B beams);
3. levels 1..L-1: one decode forward for all R * B beams (each beam's last code as input,
   attention over the shared KV and its own KV), a constrained beam step, and an in-place
   reorder of the beams' unshared KV by their parents;
4. the surviving beams' trie nodes at depth L are the semantic IDs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from xgr.beam import BeamState, constrained_beam_step
from xgr.catalog.trie import PrefixTrie
from xgr.kv import BeamKV, SharedKV
from xgr.layers.attention import DecodeMetadata, PrefillMetadata
from xgr.models.decoder import CausalLM


@dataclass
class GenerationOutput:
    """Semantic IDs found for a batch.

    Attributes:
        sid_index: (R, B) int64 row of ``ItemCatalog.semantic_ids`` per beam, best first.
        scores: (R, B) float32 summed log-probabilities; -inf where no valid path was left.
        prefill_ms: wall time of prefill and the first selection (ms).
        decode_ms: wall time of the remaining decode steps (ms).
    """

    sid_index: torch.Tensor
    scores: torch.Tensor
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


@torch.inference_mode()
def generate_semantic_ids(
    model: CausalLM,
    trie: PrefixTrie,
    sid_token_ids: torch.Tensor,
    prompts: list[list[int]],
    beam_width: int,
    top_k: int,
    attention_backend: str = "torch",
) -> GenerationOutput:
    """Constrained beam search over semantic IDs for a batch of tokenized prompts.

    Args:
        model: the decoder-only LM.
        trie: the catalog's valid-path trie, on the model's device.
        sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code, on device.
        prompts: R non-empty lists of token ids (validated by the caller).
        beam_width: beams kept per request.
        top_k: candidates per beam per step.
        attention_backend: "torch" (reference) or "triton" (GPU kernel) decode attention.

    Returns:
        The best ``beam_width`` semantic IDs of each prompt with their scores, on the host.
    """
    start = time.perf_counter()
    cfg = model.config
    device = sid_token_ids.device
    dtype = model.lm_head.weight.dtype
    num_requests, num_levels = len(prompts), sid_token_ids.shape[0]
    seqlens = [len(p) for p in prompts]
    shared = SharedKV.allocate(
        cfg.num_layers, seqlens, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)

    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in seqlens])
    cu_device = torch.tensor(cu, dtype=torch.int32, device=device)
    hidden = model(tokens, positions, PrefillMetadata(shared, cu, cu_device, max(seqlens)))
    last = torch.tensor(cu[1:], device=device) - 1
    log_probs = model.log_probs(hidden[last])  # [R, V]

    state = constrained_beam_step(
        BeamState.root(num_requests, device),
        log_probs[:, None, :],
        trie.levels[0],
        sid_token_ids[0],
        beam_width,
        top_k,
    )
    beam = BeamKV.allocate(
        cfg.num_layers,
        num_requests * beam_width,
        max(num_levels - 1, 1),
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype,
        device,
    )
    prefilled = time.perf_counter()
    prompt_lens = torch.tensor(seqlens, device=device)
    row_base = torch.arange(num_requests, device=device)[:, None] * beam_width
    meta = DecodeMetadata(shared, beam, cu, beam_width, attention_backend)
    for level in range(1, num_levels):
        ids = sid_token_ids[level - 1][state.codes].clamp(0, cfg.vocab_size - 1)
        pos = (prompt_lens + level - 1)[:, None].expand(num_requests, beam_width)
        hidden = model(ids.reshape(-1), pos.reshape(-1), meta)
        beam.length += 1
        log_probs = model.log_probs(hidden).view(num_requests, beam_width, -1)
        state = constrained_beam_step(
            state, log_probs, trie.levels[level], sid_token_ids[level], beam_width, top_k
        )
        if level < num_levels - 1:
            beam.reorder((state.parents + row_base).reshape(-1))
    nodes, scores = state.nodes.cpu(), state.scores.cpu()
    done = time.perf_counter()
    return GenerationOutput(nodes, scores, (prefilled - start) * 1e3, (done - prefilled) * 1e3)
