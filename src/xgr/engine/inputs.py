"""A batch's inputs on the device, each batch brought there by one host-to-device copy.

Two layouts of the same int64 values:

- **packed** (``prepare_inputs``), for eager runs: tokens, positions, last-token indices,
  lengths and offsets back to back, sized exactly for the batch;
- **staged** (``InputStaging``), for CUDA graphs: one buffer per ``CudaGraphs`` laid out as
  the graphs' static inputs, with room for the largest batch, so that a batch's one copy
  lands where the graphs read and no device-to-device fill runs before a replay (each such
  copy costs host time the device waits for: ``docs/performance.md``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from xgr.kv import BeamKV, SharedKV
from xgr.models.embeds import PromptEmbeds
from xgr.runner import PrefillBatch, PrefillShape
from xgr.runner.shapes import padding_segments

# Token id of a padded prefill's filler tokens (their results are never read).
PREFILL_PAD_TOKEN = 0

# One prompt's given input embeddings: (offset, (n, hidden) CPU tensor) spans, checked
# (``xgr.engine.prompt_embeds``); packing converts them to the model's dtype.
Spans = Sequence[tuple[int, torch.Tensor]]


def _int64_slots_of_rows(rows: int, row_bytes: int) -> int:
    """int64 elements holding ``rows`` embedding rows of ``row_bytes`` bytes."""
    return -(-rows * row_bytes // 8)


def _write_embeds(
    source: np.ndarray, values: torch.Tensor, spans: Sequence[Spans], offsets: Sequence[int]
) -> None:
    """Each span's rows into ``values`` (S, hidden) one after another, and their rows'
    indices into ``source`` at the spans' packed positions (``source`` already -1)."""
    row = 0
    for prompt_spans, start in zip(spans, offsets, strict=False):
        for offset, rows in prompt_spans or ():
            n = rows.shape[0]
            values[row : row + n].copy_(rows)
            source[start + offset : start + offset + n] = np.arange(row, row + n)
            row += n


def _embed_rows(spans: Sequence[Spans] | None) -> int:
    return sum(r.shape[0] for prompt in spans or () for _, r in prompt or ())


class BatchInputs:
    """A batch's inputs on the device: views of one int64 buffer, each made when first read
    (a view costs host time, and an encoder-decoder batch reads few of them).

    Attributes:
        tokens: (T,) int64 packed prompt tokens.
        positions: (T,) int64 position of each token in its prompt.
        last_index: (R,) int64 packed index of each prompt's last token.
        prompt_lens: (R,) int64 prompt lengths (tokens).
        cu_seqlens: (R + 1,) int64 prompt offsets.
        cu_seqlens_int32: (R + 1,) int32 prompt offsets (the packed attention launch).
        cu_seqlens_host: the same offsets as host ints.
        max_seqlen: the longest prompt (tokens).
        prefill_key: the shape of the CUDA graph the batch's prefill replays when the
            inputs were staged for it; None for packed inputs.
        embeds: the batch's given input embeddings (``PromptEmbeds``: views of the same
            buffer); None when its prompts have none.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        layout: dict[str, tuple[int, int]],
        cu_seqlens_host: list[int],
        max_seqlen: int,
        prefill_key: PrefillShape | None = None,
        embed_rows: tuple[int, int, torch.dtype] | None = None,
    ):
        """``buffer``: the device int64 buffer; ``layout``: each attribute's [start, stop)
        in it (``cu_seqlens_int32``'s in int64 elements, holding R + 1 int32 values;
        ``embed_values``' holding the rows' bytes); ``embed_rows``: (rows, hidden, dtype)
        of ``embed_values`` where the batch has given embeddings."""
        self._buffer = buffer
        self._layout = layout
        self.cu_seqlens_host = cu_seqlens_host
        self.max_seqlen = max_seqlen
        self.prefill_key = prefill_key
        self._embed_rows = embed_rows

    @property
    def num_requests(self) -> int:
        return len(self.cu_seqlens_host) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_host[-1]

    @property
    def seqlens(self) -> list[int]:
        cu = self.cu_seqlens_host
        return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]

    @property
    def buffer(self) -> torch.Tensor:
        """The device buffer the views are of."""
        return self._buffer

    def _view(self, name: str) -> torch.Tensor:
        if name not in self._layout:  # an encoder's staged batch has no positions
            raise ValueError(f"these inputs hold no {name}")
        start, stop = self._layout[name]
        return self._buffer[start:stop]

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        return self._view("tokens")

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return self._view("positions")

    @functools.cached_property
    def last_index(self) -> torch.Tensor:
        return self._view("last_index")

    @functools.cached_property
    def prompt_lens(self) -> torch.Tensor:
        return self._view("prompt_lens")

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        return self._view("cu_seqlens")

    @functools.cached_property
    def cu_seqlens_int32(self) -> torch.Tensor:
        return self._view("cu_seqlens_int32").view(torch.int32)[: self.num_requests + 1]

    @functools.cached_property
    def embeds(self) -> PromptEmbeds | None:
        if self._embed_rows is None:
            return None
        rows, hidden, dtype = self._embed_rows
        return PromptEmbeds(
            self._view("embed_source"),
            embed_values(self._view("embed_values"), rows, hidden, dtype),
        )

    def prefill_batch(self, shared: SharedKV, code_kv: BeamKV | None = None) -> PrefillBatch:
        """These packed inputs as an eager prefill's ``PrefillBatch`` writing ``shared``
        (``code_kv``: where level 1's rows write, when they run in the prefill)."""
        return PrefillBatch(
            self.tokens, self.positions, shared, self.cu_seqlens_host, self.cu_seqlens_int32,
            self.max_seqlen, None, self.last_index, self.prompt_lens, self.cu_seqlens,
            self.cu_seqlens_host, code_kv=code_kv, embeds=self.embeds,
        )  # fmt: skip


def embed_values(region: torch.Tensor, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, hidden) ``dtype`` view of an int64 region's bytes."""
    size = rows * hidden * dtype.itemsize
    return region.view(torch.uint8)[:size].view(dtype).view(rows, hidden)


def _int32_slots(n: int) -> int:
    """int64 elements holding n int32 values."""
    return (n + 1) // 2


def _packed_layout(total: int, num: int, embed_slots: int = -1) -> dict[str, tuple[int, int]]:
    """``prepare_inputs``' layout for ``total`` tokens of ``num`` prompts (and, with
    ``embed_slots`` >= 0, ``total`` embedding sources and that many int64 of their rows).
    Plain ints: a NumPy call per value costs more host time than the values (a few us
    each)."""
    sizes = [total, total, num, num, num + 1, _int32_slots(num + 1)]
    names = ["tokens", "positions", "last_index", "prompt_lens", "cu_seqlens", "cu_seqlens_int32"]
    if embed_slots >= 0:
        sizes += [total, embed_slots]
        names += ["embed_source", "embed_values"]
    ends = itertools.accumulate(sizes)
    layout, start = {}, 0
    for name, stop in zip(names, ends, strict=True):
        layout[name] = (start, stop)
        start = stop
    return layout


def _offsets(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    lens = [len(p) for p in prompts]
    return lens, [0, *itertools.accumulate(lens)]


def _write_tokens(host: np.ndarray, prompts: Sequence[Sequence[int]]) -> None:
    """The prompts' tokens packed into ``host`` (int64, as long as their total)."""
    if len(prompts) == 1:
        host[:] = prompts[0]
    else:
        np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts], out=host)


def _write_positions(host: np.ndarray, lens: list[int], offsets: np.ndarray) -> None:
    """Each packed token's position in its prompt, into ``host`` (int64, as long as the
    prompts' total)."""
    host[:] = np.arange(host.shape[0])
    if len(lens) > 1:
        host -= np.repeat(offsets[:-1], lens)


def prepare_inputs(
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    spans: Sequence[Spans] | None = None,
    hidden: int = 0,
    dtype: torch.dtype | None = None,
) -> BatchInputs:
    """Pack R non-empty token sequences (lists, or int64 arrays, which are not converted
    again) and copy them to ``device`` in one (async) transfer; for eager runs (the CUDA
    graphs read ``InputStaging``'s layout).

    Args:
        spans: each prompt's given input embeddings (``Spans``, checked); None: none.
        hidden, dtype: the embeddings' width and dtype (the model's), with ``spans``.

    Returns:
        The batch's packed inputs (with their ``embeds`` where ``spans`` has rows); on CUDA
        the copy is from pinned memory and does not block.
    """
    num = len(prompts)
    lens, cu = _offsets(prompts)
    rows = _embed_rows(spans)
    row_bytes = hidden * dtype.itemsize if rows else 0
    layout = _packed_layout(cu[-1], num, _int64_slots_of_rows(rows, row_bytes) if rows else -1)
    # On CUDA the buffer is pinned from the start (no staging copy), so the transfer below
    # is queued without waiting; the caching host allocator keeps it until the copy is done.
    packed = torch.empty(max(stop for _, stop in layout.values()), dtype=torch.int64,
                         pin_memory=device.type == "cuda")  # fmt: skip
    host = packed.numpy()
    offsets = np.array(cu, dtype=np.int64)

    def part(name):
        return host[slice(*layout[name])]

    _write_tokens(part("tokens"), prompts)
    _write_positions(part("positions"), lens, offsets)
    part("last_index")[:] = offsets[1:] - 1
    part("prompt_lens")[:] = lens
    part("cu_seqlens")[:] = offsets
    part("cu_seqlens_int32").view(np.int32)[: num + 1] = offsets
    embed_rows = None
    if rows:
        part("embed_source")[:] = -1
        values = embed_values(packed[slice(*layout["embed_values"])], rows, hidden, dtype)
        _write_embeds(part("embed_source"), values, spans, cu)
        embed_rows = (rows, hidden, dtype)
    return BatchInputs(
        packed.to(device, non_blocking=True), layout, cu, max(lens), None, embed_rows
    )


class InputStaging:
    """One device int64 buffer laid out as the CUDA graphs' static inputs; ``stage`` writes a
    batch there with one host-to-device copy.

    Layout, in int64 elements, for M = ``max_requests`` request slots and a prefill graph of
    P padded tokens (header regions fixed; the token regions start at ``tokens_start``):

    - ``cu_seqlens``: M + 1 prompt offsets (a batch of R uses R + 1);
    - ``prompt_lens``: M lengths; absent request slots hold 1 (an encoder graph's stand-ins);
    - ``last_index``: M packed last-token indices; absent slots hold 0;
    - ``cu_seqlens_int32``: M + 2 int32 offsets of a packed prefill graph: the R prompts',
      then the ends of the padding sequences standing in for absent requests
      (``padding_segments``), then P;
    - ``tokens``: P tokens (the prompts packed from the start, then ``PREFILL_PAD_TOKEN``);
    - ``positions``: P positions (decoder-only models), right after the P tokens; 0 for
      the padding;
    - with given input embeddings (``PrefillShape.embeds``): ``embed_source``, P int64 rows
      (-1: the token's own embedding), after the positions, then ``embed_values``, room for
      P rows of the model's embeddings (the batch's spans packed from the first), for P up
      to ``embed_tokens``.

    Every graph reads its static inputs as views of this buffer at fixed addresses (those of
    a P-token prefill overlap those of another P: replays never overlap, see
    ``CudaGraphs``). The copy runs on the current stream, so a batch's copy lands after the
    previous batch's replays on that stream have read theirs.

    Args:
        max_requests: M.
        max_tokens: the largest P.
        device: the CUDA device.
        embed_tokens: the largest P of a graph with given embeddings; 0 for none.
        hidden, dtype: the embeddings' width and dtype (the model's), with ``embed_tokens``.
    """

    def __init__(
        self,
        max_requests: int,
        max_tokens: int,
        device: torch.device,
        embed_tokens: int = 0,
        hidden: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.embed_tokens, self.hidden, self.dtype = embed_tokens, hidden, dtype
        self.row_bytes = hidden * dtype.itemsize if embed_tokens else 0
        sizes = {
            "cu_seqlens": max_requests + 1,
            "prompt_lens": max_requests,
            "last_index": max_requests,
            "cu_seqlens_int32": _int32_slots(max_requests + 2),
        }
        self._header: dict[str, int] = {}
        start = 0
        for name, size in sizes.items():
            self._header[name] = start
            start += -(-size // 2) * 2  # 16-byte aligned regions
        self.tokens_start = -(-start // 64) * 64
        embeds = 3 * embed_tokens + _int64_slots_of_rows(embed_tokens, self.row_bytes)
        # Zeros: valid token ids and positions wherever a batch leaves the buffer unwritten.
        self.buffer = torch.zeros(
            self.tokens_start + max(2 * max_tokens, embeds), dtype=torch.int64, device=device
        )

    def region(self, name: str, size: int, padded: int = 0) -> torch.Tensor:
        """The first ``size`` elements of a region (``padded``: P, to place the regions
        after the tokens)."""
        if name == "tokens":
            start = self.tokens_start
        elif name == "positions":
            start = self.tokens_start + padded
        elif name == "embed_source":
            start = self.tokens_start + 2 * padded
        elif name == "embed_values":
            start = self.tokens_start + 3 * padded
        else:
            start = self._header[name]
        view = self.buffer[start : start + size]
        return view.view(torch.int32)[: size * 2] if name == "cu_seqlens_int32" else view

    def embeds(self, padded: int) -> PromptEmbeds:
        """The given embeddings a graph of P = ``padded`` tokens reads: P sources, room for
        P rows."""
        values = self.region("embed_values", _int64_slots_of_rows(padded, self.row_bytes), padded)
        return PromptEmbeds(
            self.region("embed_source", padded, padded),
            embed_values(values, padded, self.hidden, self.dtype),
        )

    def cu_seqlens_int32(self, entries: int) -> torch.Tensor:
        """The first ``entries`` int32 offsets of the packed prefill."""
        return self.region("cu_seqlens_int32", _int32_slots(entries))[:entries]

    def stage(
        self,
        prompts: Sequence[Sequence[int]],
        shape: PrefillShape,
        spans: Sequence[Spans] | None = None,
    ) -> BatchInputs:
        """Write R non-empty prompts (lists or int64 arrays) for a prefill graph of this
        shape (``shape.slots`` request slots, ``shape.padded_tokens`` tokens, positions if
        ``shape.reads_positions``, the prompts' given embeddings ``spans`` if
        ``shape.embeds``), in one async copy from pinned memory.

        Returns:
            The batch's inputs as views of this buffer, valid until the next ``stage`` (an
            encoder's hold no positions); ``shape`` is their ``prefill_key``.

        Raises:
            ValueError: no prompts or an empty one, more prompts than ``slots``, ``slots``
                above M, more tokens than ``padded``, ``padded`` above ``max_tokens``,
                (``positions``) no more padding than absent prompts, or (``shape.embeds``)
                ``padded`` above ``embed_tokens``.
        """
        slots, padded, positions = shape.slots, shape.padded_tokens, shape.reads_positions
        num = len(prompts)
        lens, cu = _offsets(prompts)
        total = cu[-1]
        if not num or not min(lens):
            raise ValueError("staging needs at least one prompt, each of at least one token")
        # A decoder-only graph's padding forms one sequence of at least a token per absent
        # request plus one more (``padding_segments``).
        padding = padded - total if positions else 0
        if (
            not num <= slots <= self.max_requests
            or not total <= padded <= self.max_tokens
            or (positions and padding <= slots - num)
        ):
            note = "; the padding needs more than a token per absent prompt" if positions else ""
            raise ValueError(
                f"{num} prompts of {total} tokens do not fit a staged graph of {slots} slots "
                f"and {padded} tokens (at most {self.max_requests} and {self.max_tokens}{note})"
            )
        if shape.embeds and padded > self.embed_tokens:
            raise ValueError(
                f"a graph of {padded} tokens with given embeddings is above this staging "
                f"buffer's {self.embed_tokens}"
            )
        start = self.tokens_start
        rows = _embed_rows(spans) if shape.embeds else 0
        # A decoder-only graph reads all P tokens and positions: every one is written (an
        # unwritten position could be a stale token id, past the rotary table).
        stop = start + (2 * padded if positions else total)
        if shape.embeds:
            stop = start + 3 * padded + _int64_slots_of_rows(rows, self.row_bytes)
        staged = torch.empty(stop, dtype=torch.int64, pin_memory=self.buffer.is_cuda)
        host = staged.numpy()
        host[:start] = 0
        offsets = np.array(cu, dtype=np.int64)
        header = self._header
        host[header["cu_seqlens"] :][: num + 1] = offsets
        lens_region = host[header["prompt_lens"] :][:slots]
        lens_region[:num] = lens
        lens_region[num:] = 1
        host[header["last_index"] :][:num] = offsets[1:] - 1
        cu32 = host[header["cu_seqlens_int32"] :].view(np.int32)[: slots + 2]
        cu32[: num + 1] = offsets
        stand_ins = slots - num
        if stand_ins:
            seg, _ = padding_segments(padded - total, stand_ins)
            cu32[num + 1 : slots + 1] = total + seg * np.arange(1, stand_ins + 1)
        cu32[slots + 1] = padded
        _write_tokens(host[start : start + total], prompts)
        if positions:
            host[start + total : start + padded] = PREFILL_PAD_TOKEN
            _write_positions(host[start + padded :][:total], lens, offsets)
            host[start + padded + total : start + 2 * padded] = 0
        if shape.embeds:
            if not positions:
                host[start + total : start + 2 * padded] = 0
            source = host[start + 2 * padded : start + 3 * padded]
            source[:] = -1
            values = embed_values(staged[start + 3 * padded :], rows, self.hidden, self.dtype)
            _write_embeds(source, values, spans or (), cu)
        self.buffer[:stop].copy_(staged, non_blocking=True)
        layout = {
            "tokens": (start, start + total),
            "cu_seqlens": (header["cu_seqlens"], header["cu_seqlens"] + num + 1),
            "prompt_lens": (header["prompt_lens"], header["prompt_lens"] + num),
            "last_index": (header["last_index"], header["last_index"] + num),
            "cu_seqlens_int32": (
                header["cu_seqlens_int32"],
                header["cu_seqlens_int32"] + _int32_slots(num + 1),
            ),
        }
        if positions:
            layout["positions"] = (start + padded, start + padded + total)
        embed_rows = None
        if shape.embeds:
            layout["embed_source"] = (start + 2 * padded, start + 3 * padded)
            slots_of_values = _int64_slots_of_rows(padded, self.row_bytes)
            layout["embed_values"] = (start + 3 * padded, start + 3 * padded + slots_of_values)
            embed_rows = (padded, self.hidden, self.dtype)
        return BatchInputs(self.buffer, layout, cu, max(lens), shape, embed_rows)
