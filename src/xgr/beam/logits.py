"""Next-code log-probabilities from final hidden states, computed only where beam search needs them.

A decode step scores each beam's candidates, which are codes of one level: the LM head is
applied to those codes' rows only (C of the V vocabulary rows), and the full-vocabulary
normalizer log-sum-exp(h . W_v) is computed in vocabulary chunks, so the (N, V) float32
log-softmax is never materialized. The result equals ``log_softmax(h @ W.T)`` at the level's
codes, as HF ``generate`` scores them (exactly in float32; in bf16 the code logits are not
rounded to bf16, see ``level_head_weights``).
"""

from __future__ import annotations

import torch

# Bytes of logit buffers per vocabulary chunk of the log-sum-exp (the model-dtype product,
# plus its float32 copy on the torch path): about 384 MB whatever the number of rows.
LSE_CHUNK_BYTES = 384 << 20


def level_head_weights(lm_head_weight: torch.Tensor, sid_token_ids: torch.Tensor) -> torch.Tensor:
    """The LM-head rows of every level's codes, in float32.

    Code logits are computed in float32 from them: in bf16 a logit near 10 is rounded to
    steps of 0.06, which turns close candidates into exact ties that any upstream rounding
    difference reorders; HF rounds logits to the model dtype, so in bf16 xgr's scores are the
    more exact of the two.

    Args:
        lm_head_weight: (vocab_size, hidden_size) in the model dtype.
        sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code.

    Returns:
        (num_levels, codebook_size, hidden_size) float32 copy.
    """
    ids = sid_token_ids.clamp(0, lm_head_weight.shape[0] - 1)
    return lm_head_weight[ids].float().contiguous()


def full_vocab_logsumexp(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """log-sum-exp over the whole vocabulary of each row's logits, chunked over the vocabulary.

    On CUDA each chunk's logits are reduced by one Triton pass
    (``xgr.kernels.triton_logsumexp``), all chunks' partial results merged at the end; on
    the CPU by ``torch.logsumexp`` (the reference).

    Args:
        hidden: (N, hidden_size) final hidden states, model dtype.
        lm_head_weight: (vocab_size, hidden_size), model dtype.

    Returns:
        (N,) float32. Logits are rounded to the model dtype before the float32 reduction, as
        HF computes ``lm_head(h).float()``.
    """
    if hidden.is_cuda:
        return torch.logsumexp(full_vocab_partials(hidden, lm_head_weight), dim=-1)
    vocab, rows = lm_head_weight.shape[0], max(hidden.shape[0], 1)
    chunk = max(1024, LSE_CHUNK_BYTES // ((hidden.element_size() + 4) * rows))
    total = None
    for start in range(0, vocab, chunk):
        part = torch.logsumexp((hidden @ lm_head_weight[start : start + chunk].T).float(), dim=-1)
        total = part if total is None else torch.logaddexp(total, part)
    return total


def full_vocab_partials(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """Log-sum-exps of blocks of each row's full-vocabulary logits (CUDA): each vocabulary
    chunk's model-dtype product reduced by one Triton pass
    (``xgr.kernels.triton_logsumexp.row_logsumexp_partials``).

    Args:
        hidden: (N, hidden_size) final hidden states, model dtype, on CUDA.
        lm_head_weight: (vocab_size, hidden_size), model dtype.

    Returns:
        (N, P) float32; their log-sum-exp over P is ``full_vocab_logsumexp``.
    """
    from xgr.kernels.triton_logsumexp import num_partials, row_logsumexp_partials

    vocab, rows = lm_head_weight.shape[0], max(hidden.shape[0], 1)
    chunk = max(1024, LSE_CHUNK_BYTES // (hidden.element_size() * rows))
    starts = range(0, vocab, chunk)
    widths = [min(chunk, vocab - start) for start in starts]
    counts = [num_partials(hidden.shape[0], w, hidden.device) for w in widths]
    partials = torch.empty(hidden.shape[0], sum(counts), dtype=torch.float32, device=hidden.device)
    col = 0
    for start, count in zip(starts, counts, strict=True):
        logits = hidden @ lm_head_weight[start : start + chunk].T
        row_logsumexp_partials(logits, partials[:, col : col + count])
        col += count
    return partials


def distinct_code_mask(sid_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Which codes are distinct in-vocabulary tokens, per level.

    A code map may give unused codes -1 or an id outside the vocabulary, and two codes the
    same token; such codes must not count (twice) in a normalizer.

    Args:
        sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code.
        vocab_size: the model's vocabulary size.

    Returns:
        (num_levels, codebook_size) bool on the ids' device; True for the first code of each
        distinct in-vocabulary token of its level.
    """
    ids = sid_token_ids.cpu()
    mask = (ids >= 0) & (ids < vocab_size)
    for level in range(ids.shape[0]):
        seen: set[int] = set()
        for code, token in enumerate(ids[level].tolist()):
            if mask[level, code] and token in seen:
                mask[level, code] = False
            seen.add(token)
    return mask.to(sid_token_ids.device)


def code_log_probs_reference(
    logits: torch.Tensor,
    lse: torch.Tensor | None,
    code_mask: torch.Tensor | None,
    model_dtype: torch.dtype,
) -> torch.Tensor:
    """The torch reference: mask, then normalize over the codes or the whole vocabulary.

    With a full-vocabulary normalizer in a half dtype, lse = log(sum_V) holds the codes'
    logits rounded; the result normalizes by log(sum_V - sum_codes_rounded + sum_codes), so
    that no log-probability exceeds 0 (computed stably, clamping the difference at 0).

    Args:
        logits: (N, C) float32 code logits.
        lse: (N,) float32 full-vocabulary log-sum-exp of the model-dtype logits, or None.
        code_mask, model_dtype: as ``xgr.kernels.triton_code_log_probs.code_log_probs_from_logits``.

    Returns:
        (N, C) float32.
    """
    if code_mask is not None:
        logits = logits.masked_fill(~code_mask, float("-inf"))
    if lse is None:
        return torch.log_softmax(logits, dim=-1)
    if model_dtype != torch.float32:
        rounded = torch.logsumexp(logits.to(model_dtype).float(), dim=-1)
        rest = torch.log((1 - torch.exp(rounded - lse)).clamp(min=0)) + lse
        lse = torch.logaddexp(rest, torch.logsumexp(logits, dim=-1))
    return logits - lse[:, None]


def code_log_probs(
    hidden: torch.Tensor,
    level_weight: torch.Tensor,
    lm_head_weight: torch.Tensor | None,
    code_mask: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of one level's codes.

    Args:
        hidden: (N, hidden_size) final hidden states, model dtype.
        level_weight: (codebook_size, hidden_size) LM-head rows of the level's codes:
            float32, or (CUDA only) the model dtype, whose product a tensor-core GEMM
            accumulates and returns in float32 (``DecodeSpec.build`` stores them so).
        lm_head_weight: (vocab_size, hidden_size) full LM head, to normalize over the whole
            vocabulary (exact next-token log-probabilities); None to normalize over the
            level's codes only (for models whose vocabulary is only semantic-ID codes).
        code_mask: (codebook_size,) bool, the codes that are distinct in-vocabulary tokens
            (``distinct_code_mask``); None: all codes.
        partials: (N, P) float32 ``full_vocab_partials`` of these rows, already computed
            (CUDA: together with other rows, in one pass over the LM head); None computes
            them here. Ignored without ``lm_head_weight`` and on the CPU.

    Returns:
        (N, codebook_size) float32; -inf for codes outside ``code_mask``. In bf16/fp16 the
        full-vocabulary normalizer takes the codes' float32 logits in place of their rounded
        ones (the rest of the vocabulary stays rounded), so no log-probability exceeds 0.
    """
    if level_weight.dtype == torch.float32:
        logits = hidden.float() @ level_weight.T
    else:
        # The same float32 logits (bf16 x bf16 products are exact in float32, the sums
        # float32 either way) from one tensor-core GEMM, without a float32 copy of the
        # hidden rows and cuBLAS's slower float32 GEMM.
        logits = torch.mm(hidden, level_weight.T, out_dtype=torch.float32)
    if hidden.is_cuda:  # one Triton pass after the GEMMs, where torch takes ~35 kernels
        from xgr.kernels.triton_code_log_probs import code_log_probs_from_logits

        if lm_head_weight is None:
            partials = None
        elif partials is None:
            partials = full_vocab_partials(hidden, lm_head_weight)
        return code_log_probs_from_logits(logits, partials, code_mask, hidden.dtype)
    lse = None if lm_head_weight is None else full_vocab_logsumexp(hidden, lm_head_weight)
    return code_log_probs_reference(logits, lse, code_mask, hidden.dtype)
