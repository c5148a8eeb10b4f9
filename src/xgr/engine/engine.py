"""``xgr.Engine``: recommendations for prompts by catalog-constrained beam search."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xgr.catalog import ItemCatalog, TitleIndex
from xgr.core import (
    PromptTooLongError,
    RecommendResult,
    SearchParams,
    XgrError,
    positive_int,
)
from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.decode import runs_first_levels_together
from xgr.engine.generate import launch_semantic_ids
from xgr.engine.model_folder import load_engine
from xgr.engine.prompt import (
    PromptFormat,
    integer_tokens,
    refuse_unencodable_text,
    refuse_unknown_pieces,
)
from xgr.engine.results import PendingRecommendation, excluded_items, search_params
from xgr.engine.spec import DecodeSpec
from xgr.engine.streams import CaptureGate, exclusive_stream
from xgr.engine.warm_up import capture_lanes
from xgr.kernels.backend import select_attention_backend
from xgr.models import CausalLM, T5Seq2SeqLM
from xgr.models.sid_vocab import (
    validate_sid_token_ids,
)

logger = logging.getLogger(__name__)

# How often a launch waiting for a lane checks whether a launched batch has finished (s).
LANE_POLL_SECONDS = 0.01


Prompt = Sequence[int] | str


class Engine:
    """Serves recommendations from one model and one catalog.

    Args:
        model: the decoder-only LM or the T5 encoder-decoder, already on its device and
            dtype; projections that read one input are fused in place
            (``fuse_projections``). On CUDA a T5 model's encoder and its decoder levels
            replay CUDA graphs, with Triton kernels for cross- and self-attention.
        catalog: the items served.
        sid_token_ids: (num_levels, codebook_size) int array, vocabulary id of each code.
        tokenizer: optional ``tokenizers.Tokenizer`` for string prompts.
        name: model name reported by the server.
        prompt_format: how histories become prompts (default: the items' tokens alone).
        titles: item id -> title, copied into results (default: none).
        full_vocab: score codes by their log-probability over the whole vocabulary (exact,
            as HF ``generate``); False normalizes over each level's codes only, which skips
            the full-vocabulary LM head (for models whose vocabulary is only the codes).
        cuda_graphs: on CUDA, replay the decode levels from CUDA graphs (one per batch
            shape, captured on first use); False decodes eagerly.
        cuda_streams: on CUDA, how many batches may run at once, each on its own stream with
            its own graphs and prompt-KV pool (the weights are shared). 1 (the default) runs
            on the current stream.
        pipeline_depth: on CUDA, batches launched per stream before the first is collected
            (``recommend_async``): with 2, the host prepares and queues the next batch while
            the device computes the current one, so the device does not wait for the host
            between batches. ``recommend`` is safe to call from ``lanes`` (streams x depth)
            threads at once (the scheduler's ``max_inflight``).

    Raises:
        XgrError: the code map does not match the catalog or the model's vocabulary.
    """

    def __init__(
        self,
        model: CausalLM | T5Seq2SeqLM,
        catalog: ItemCatalog,
        sid_token_ids: Any,
        tokenizer: Any = None,
        name: str = "xgr-model",
        prompt_format: PromptFormat | None = None,
        titles: dict[str, str] | None = None,
        full_vocab: bool = True,
        cuda_graphs: bool = True,
        cuda_streams: int = 1,
        pipeline_depth: int = 2,
    ) -> None:
        encdec = model.is_encoder_decoder
        model.fuse_projections()  # one GEMM where projections read the same input
        self.model = model
        self.catalog = catalog
        self.tokenizer = tokenizer
        self.name = name
        self.prompt_format = prompt_format or PromptFormat()
        self.titles = titles or {}
        self.title_index = TitleIndex(catalog, self.titles)
        self.device = model.lm_head.weight.device
        table = validate_sid_token_ids(sid_token_ids, catalog, model.config.vocab_size)
        self.sid_token_ids = torch.from_numpy(table).to(self.device)
        self._sid_token_ids_host = table
        self.trie = catalog.trie.to(self.device)
        self.attention_backend = select_attention_backend(self.device, model.shared_kv_layout[2])
        self.decode_spec = DecodeSpec.build(
            model, self.trie, self.sid_token_ids, full_vocab, self.attention_backend
        )
        cuda = self.device.type == "cuda"
        cuda_streams = positive_int("cuda_streams", cuda_streams)
        pipeline_depth = positive_int("pipeline_depth", pipeline_depth)
        lanes = cuda_streams if cuda else 1
        if cuda_streams > 1 and not cuda:
            logger.warning("cuda_streams=%d ignored on the CPU: one batch at a time", cuda_streams)
        self.graphs = CudaGraphs(model) if cuda_graphs and cuda else None
        # Streams run batches concurrently. One stream is the one current at construction,
        # fixed, so that its batches queue in order whichever thread launches them; several
        # are streams of their own. Lane 0 replays ``self.graphs``, the others their own.
        self._streams = (
            [exclusive_stream(self, self.device, "lane") for _ in range(lanes)]
            if lanes > 1
            else [torch.cuda.current_stream(self.device) if cuda else None]
        )
        self._lane_graphs = [CudaGraphs(model) if cuda_graphs else None for _ in range(lanes - 1)]
        self._gate = CaptureGate()  # a lane that captures a graph runs alone
        # A lane is taken for a batch from its launch until its results reach the host; each
        # stream is pipeline_depth lanes (its batches queue behind each other on the device).
        self._lanes: queue.SimpleQueue[int] = queue.SimpleQueue()
        for _ in range(pipeline_depth if cuda else 1):
            for lane in range(lanes):
                self._lanes.put(lane)
        self._depth = pipeline_depth if cuda else 1
        self._lane_lock = threading.Lock()
        self._in_flight: dict[int, PendingRecommendation] = {}  # launched, lane still held
        if not encdec and self.max_prompt_tokens < 1:
            raise XgrError(
                f"max_position_embeddings {model.config.max_position_embeddings} leaves no room "
                f"for a prompt and {catalog.num_levels} generated codes"
            )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        catalog: ItemCatalog | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        sid_token_ids: Any = None,
        **options: Any,
    ) -> Engine:
        """Load a model folder and serve ``catalog`` with it.

        Args:
            model_dir: HF folder with config.json and safetensors weights (single or sharded)
                of a Qwen2, Qwen3, Llama or T5 model (by config.json's ``model_type``).
            catalog: the catalog; default ``<model_dir>/catalog.index.json``.
            device: "cpu" (the torch reference path) or "cuda" (Triton decode attention).
            dtype: "float32", "bfloat16" or "float16".
            sid_token_ids: (num_levels, codebook_size) code -> token id map; default found
                from the folder's tokenizer tokens named like the catalog's codes (``<a_12>``).
            options: ``full_vocab``, ``cuda_graphs`` and ``cuda_streams``, passed to ``Engine``.

        Raises:
            XgrError: unreadable folder or weights, no catalog, a catalog whose fingerprint
                differs from the one saved beside the model, or a code map that does not fit.
        """
        return load_engine(
            Path(model_dir), catalog, device, dtype, sid_token_ids,
            lambda **parts: cls(**parts, **options),
        )  # fmt: skip

    @property
    def lanes(self) -> int:
        """Batches this engine can have in flight at once: ``cuda_streams`` x
        ``pipeline_depth`` on CUDA, else 1."""
        return len(self._streams) * self._depth

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted (tokens).

        Decoder-only: positions must cover the generated codes too. T5: the config's
        ``max_prompt_tokens`` (the decoder has positions of its own).
        """
        if self.model.is_encoder_decoder:
            return self.model.config.max_prompt_tokens
        return self.model.config.max_position_embeddings - self.catalog.num_levels + 1

    def history_prompt(self, history: Sequence[Any], truncate: bool = False) -> list[int]:
        """The prompt (token ids) for a history of item ids, oldest first.

        Args:
            history: item ids of the catalog.
            truncate: drop the oldest items until the prompt fits the model; without it a
                prompt that is too long raises at ``recommend``.

        Raises:
            XgrError: empty history or unknown item ids.
        """
        limit = self.max_prompt_tokens if truncate else None
        return self.prompt_format.build(history, self.catalog, self._sid_token_ids_host, limit)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt as token ids, validated. Raises XgrError for an unusable prompt."""
        return self.token_ids(prompt).tolist()

    def token_ids(self, prompt: Prompt) -> np.ndarray:
        """``tokenize`` as a new (tokens,) int64 NumPy array, the form the batch packing
        copies to the device. Callers that validate a prompt before queueing it (the server)
        keep this array: ``recommend`` checks an int64 array in ~15 us for 5000 tokens, a
        list in ~300 us, and turning the array back into a list cost ~120 us more (2-core
        CPU). Converting and checking a 5000-token list element by element in Python took
        about 1 ms of host time per request on the H200 machine.

        Raises:
            XgrError: an unusable prompt (``PromptTooLongError`` above the model's limit).
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise XgrError("string prompts need a tokenizer in the model folder")
            refuse_unencodable_text(prompt)
            encoding = self.tokenizer.encode(prompt, add_special_tokens=False)
            refuse_unknown_pieces(self.tokenizer, prompt, encoding)
            tokens = np.array(encoding.ids, dtype=np.int64)
        else:
            tokens = integer_tokens(prompt)
        if not tokens.size:
            raise XgrError("empty prompt: at least one token is needed")
        if tokens.size > self.max_prompt_tokens:
            why = (
                "config.json's n_positions, or xgr's default for T5"
                if self.model.is_encoder_decoder
                else "max positions minus generated codes"
            )
            raise PromptTooLongError(
                f"prompt of {tokens.size} tokens exceeds the model's limit of "
                f"{self.max_prompt_tokens} ({why})"
            )
        vocab = self.model.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise XgrError(f"prompt token ids must be in [0, {vocab})")
        return tokens.astype(np.int64, copy=False)

    def recommend(
        self,
        prompts: Sequence[Prompt],
        beam_width: int = 64,
        top_k: int = 64,
        num_results: int | Sequence[int] = 10,
        exclude_item_ids: Sequence[Iterable[Any]] | None = None,
    ) -> list[RecommendResult]:
        """Recommend items for each prompt.

        Args:
            prompts: token-id lists, or strings when the model folder has a tokenizer.
            beam_width: beams kept per decode step.
            top_k: candidates per beam per step.
            num_results: semantic IDs returned per prompt (one int, or one per prompt), best
                first; each brings all its (non-excluded) items, so collisions can make
                ``items`` longer.
            exclude_item_ids: per prompt, item ids to leave out of ``items`` (e.g. the
                history); semantic IDs whose items are all excluded are skipped and the next
                best of the beam_width final beams are taken instead.

        Returns:
            One ``RecommendResult`` per prompt, in order.

        Raises:
            XgrError: bad search parameters or prompts (empty, out-of-vocab ids).
            PromptTooLongError: a prompt longer than ``max_prompt_tokens``.
            ModelOutputError: the model gave no finite score for a prompt.
        """
        return self.recommend_async(
            prompts, beam_width, top_k, num_results, exclude_item_ids
        ).result()

    def recommend_async(
        self,
        prompts: Sequence[Prompt],
        beam_width: int = 64,
        top_k: int = 64,
        num_results: int | Sequence[int] = 10,
        exclude_item_ids: Sequence[Iterable[Any]] | None = None,
    ) -> PendingRecommendation:
        """``recommend``, returning once the batch's device work is queued (on CUDA; on the
        CPU once it is done). Arguments and input errors as ``recommend``; blocks while
        ``lanes`` batches are in flight.

        Returns:
            A ``PendingRecommendation``; its ``result()`` waits for the device and gives
            ``recommend``'s results (or raises its ``ModelOutputError``).
        """
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise XgrError("prompts must be a list of prompts")
        search, params = search_params(len(prompts), beam_width, top_k, num_results)
        tokenized = [self.token_ids(p) for p in prompts]
        excluded = excluded_items(len(prompts), exclude_item_ids)
        if not tokenized:
            return PendingRecommendation(self, None, [], [], [], None)
        lane = self._take_lane()
        try:
            pending = self._launch(lane, tokenized, search)
        except BaseException:
            self._lanes.put(lane)
            raise
        launched = PendingRecommendation(self, pending, tokenized, params, excluded, lane)
        if pending.events is None:  # the CPU: the work is done
            launched._release()
        else:
            with self._lane_lock:
                self._in_flight[id(launched)] = launched
        return launched

    def _launch(self, lane: int, tokenized: list[np.ndarray], search: SearchParams):
        """Queue a batch on a lane: alone (``CaptureGate.exclusive``) if it captures a graph,
        else beside other launches. With several lanes, whether it captures is checked again
        under the graphs' lock once the shared gate is held: another batch of the same lane
        may have dropped graphs (a pool growth) since the first check."""
        stream = self._streams[lane]
        graphs = self._lane_graphs[lane - 1] if lane else self.graphs
        level_one = runs_first_levels_together(self.decode_spec, len(tokenized), search.beam_width)
        shape = ([len(t) for t in tokenized], search.beam_width, search.top_k, level_one)
        concurrent = graphs is not None and self.lanes > 1
        alone = concurrent and graphs.needs_capture(*shape)
        while True:
            with (
                self._gate.exclusive() if alone else self._gate.shared(),
                torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
                graphs.lock if concurrent else contextlib.nullcontext(),
            ):
                if alone or not concurrent or not graphs.needs_capture(*shape):
                    return launch_semantic_ids(
                        self.decode_spec, tokenized, search.beam_width, search.top_k, graphs
                    )
            alone = True

    def _take_lane(self) -> int:
        """A free lane; while there is none, batches whose device work has finished give
        theirs back even if nobody has collected them (a caller that launches more batches
        than ``lanes`` without collecting waits for the device, not forever)."""
        while True:
            try:
                return self._lanes.get(timeout=LANE_POLL_SECONDS)
            except queue.Empty:
                with self._lane_lock:
                    launched = list(self._in_flight.values())
                for batch in launched:
                    if batch._device_done():
                        batch._release()

    def warm_up(
        self,
        prompt_tokens: int,
        beam_width: int,
        top_k: int,
        max_batch_size: int,
        spread: float = 0.2,
    ) -> int:
        """Capture, on every lane, the CUDA graphs that batches of such requests replay.

        Under load the first batch of each shape would otherwise pay for its capture (a
        warm-up forward plus the capture itself, tens to hundreds of ms) and miss its
        deadline. Runs batches of 1..max_batch_size prompts whose lengths cover
        prompt_tokens x (1 +- spread), one per prefill bucket they fall in; a no-op on the CPU.

        Args:
            prompt_tokens: typical prompt length (tokens), >= 1.
            beam_width, top_k: the search parameters requests will use.
            max_batch_size: the scheduler's largest batch (requests).
            spread: relative spread of prompt lengths around prompt_tokens, in [0, 1).

        Returns:
            Graphs captured (all lanes together).

        Raises:
            XgrError: bad arguments, or prompts longer than ``max_prompt_tokens``.
        """
        SearchParams(beam_width, top_k, 1)
        prompt_tokens = positive_int("prompt_tokens", prompt_tokens)
        max_batch_size = positive_int("max_batch_size", max_batch_size)
        spread_ok = isinstance(spread, int | float) and not isinstance(spread, bool)
        if not (spread_ok and 0 <= spread < 1):
            raise XgrError(f"spread must be a number in [0, 1), got {spread!r}")
        if prompt_tokens > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"warm-up prompts of {prompt_tokens} tokens exceed {self.max_prompt_tokens}"
            )
        lanes = [self.graphs, *self._lane_graphs]
        if self.device.type != "cuda" or lanes[0] is None:
            return 0
        # Longer prompts are refused at admission: no batch of them needs a graph.
        longest = min(int(prompt_tokens * (1 + spread)), self.max_prompt_tokens)
        shortest = max(1, int(prompt_tokens * (1 - spread)))
        batches = (shortest, longest, max_batch_size)
        return capture_lanes(self.decode_spec, lanes, self._streams, batches, beam_width, top_k)
