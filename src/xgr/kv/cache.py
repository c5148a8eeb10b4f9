"""KV storage of a batch: the shared prompt KV and the beams' unshared KV.

For a batch of R requests with beam width B (N = R * B beam rows):

- ``SharedKV`` holds every request's prompt KV once, packed along the token axis in
  request order; request r owns tokens ``cu_seqlens[r]:cu_seqlens[r + 1]``. Decode steps
  read it for all beams of the request and never copy it per beam.
- ``BeamKV`` holds each beam's own generated tokens, token-granular, at most
  ``capacity`` (the number of levels) per beam. Row ``r * B + b`` is beam b of request r.
  Each token is written once, at the row of the beam that generated it; after beam
  selection only a small index (each beam's ancestry: the row of its t-th token) is
  updated, so forking beams copies no KV. Copying the written slots instead cost about as
  much as the attention itself per layer and step, while reading through the index cost
  nothing measurable (``benchmarks/attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedKV:
    """Prompt KV of a batch, stored once per request.

    Attributes:
        k, v: (num_layers, total_prompt_tokens, num_kv_heads, head_dim), model dtype;
            possibly strided views of ``token_major``.
        cu_seqlens: (R + 1,) int64 token offsets of each request, on the KV's device.
        seqlens: prompt length (tokens) of each request, on the host.
        token_major: None, or the (total_prompt_tokens, num_layers, 2, num_kv_heads,
            head_dim) buffer that k ([:, :, 0]) and v ([:, :, 1]) view: one row per token
            holding every layer's K and V, so one GEMM writes all layers at once (a T5
            encoder output's cross-attention K/V, ``kv_buffers``).
    """

    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    seqlens: list[int]
    token_major: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        seqlens: list[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        cu_seqlens: torch.Tensor | None = None,
        token_major: bool = False,
    ) -> SharedKV:
        """Buffers for prompts of ``seqlens`` tokens.

        Args:
            cu_seqlens: the (R + 1,) int64 offsets, already on ``device``; None: made from
                seqlens (a host-to-device copy, which the sync-free generation path avoids).
            token_major: lay k and v out as views of one token-major buffer (``kv_buffers``).
        """
        if cu_seqlens is None:
            cu = torch.zeros(len(seqlens) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0)
            cu_seqlens = cu.to(device)
        k, v, buffer = kv_buffers(
            num_layers, sum(seqlens), num_kv_heads, head_dim, dtype, device, token_major
        )
        return cls(k, v, cu_seqlens, list(seqlens), buffer)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def kv_buffers(
    num_layers: int,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    token_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Uninitialized prompt K and V of ``num_tokens`` tokens.

    Returns:
        k, v: (num_layers, num_tokens, num_kv_heads, head_dim) in ``dtype``: contiguous
            tensors of their own, or with ``token_major`` strided views (last dimension
            contiguous) of the third tensor;
        buffer: None, or with ``token_major`` the (num_tokens, num_layers, 2, num_kv_heads,
            head_dim) tensor they view.
    """
    if not token_major:
        shape = (num_layers, num_tokens, num_kv_heads, head_dim)
        k = torch.empty(shape, dtype=dtype, device=device)
        return k, torch.empty_like(k), None
    shape = (num_tokens, num_layers, 2, num_kv_heads, head_dim)
    buffer = torch.empty(shape, dtype=dtype, device=device)
    k, v = (buffer[:, :, i].permute(1, 0, 2, 3) for i in (0, 1))
    return k, v, buffer


@dataclass
class BeamKV:
    """Unshared KV of every beam of a batch.

    Attributes:
        k, v: (num_layers, N, capacity, num_kv_heads, head_dim), model dtype; slot t holds
            the beam's t-th generated token.
        rows: (N, capacity) int32, the row holding slot t of beam n (its ancestry). Slot t
            is written at row n by the beam that is row n at step t, so column t starts as
            the identity and ``reorder`` rewrites the written columns.
        length: slots written so far (the same for every beam: decoding is fixed-step).
    """

    k: torch.Tensor
    v: torch.Tensor
    rows: torch.Tensor
    length: int = 0

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_rows: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> BeamKV:
        shape = (num_layers, num_rows, capacity, num_kv_heads, head_dim)
        rows = torch.arange(num_rows, dtype=torch.int32, device=device)[:, None]
        return cls(
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
            rows.expand(num_rows, capacity).contiguous(),
        )

    def reorder(self, parent_rows: torch.Tensor) -> None:
        """Make beam i continue beam ``parent_rows[i]``: it inherits the parent's ancestry.

        Only the index changes, in place; no KV is copied. With n < N parents only the
        first n rows are rewritten (the beams of a step that runs on fewer rows).

        Args:
            parent_rows: (n,) int64 row of each new beam's parent, n <= N.
        """
        if self.length == 0:
            return
        written = self.rows[:, : self.length]
        written[: parent_rows.shape[0]].copy_(written.index_select(0, parent_rows))

    def first_rows(self, num_rows: int) -> BeamKV:
        """The same KV with only the first ``num_rows`` rows' ancestry: the view a decode
        step over that many beams reads (its rows are beams 0 .. num_rows - 1)."""
        return BeamKV(self.k, self.v, self.rows[:num_rows], self.length)

    def gather(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each beam's first ``num_tokens`` tokens of one layer, following its ancestry.

        Used by the reference attention path; the GPU kernel reads through ``rows`` itself.

        Returns:
            k, v: (N, num_tokens, num_kv_heads, head_dim) copies.
        """
        slots = torch.arange(num_tokens, device=self.rows.device)[None, :]
        rows = self.rows[:, :num_tokens].long()
        return self.k[layer][rows, slots], self.v[layer][rows, slots]
