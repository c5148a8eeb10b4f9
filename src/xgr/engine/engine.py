"""``xgr.Engine``: recommendations for prompts by catalog-constrained beam search."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from xgr.catalog import ItemCatalog, TitleIndex
from xgr.catalog.rules import CatalogMasks, request_rules
from xgr.catalog.updates import CatalogUpdate, apply_update
from xgr.core import (
    Prompt,
    PromptTooLongError,
    RecommendResult,
    SearchParams,
    XgrError,
    positive_int,
)
from xgr.engine.catalog_version import CatalogVersion
from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.generate import launch_semantic_ids
from xgr.engine.graph_keys import EAGER
from xgr.engine.lanes import Lane, Lanes
from xgr.engine.model_folder import ChatTemplate, load_engine
from xgr.engine.prompt import (
    PromptFormat,
    each_prompt,
    integer_tokens,
    refuse_unencodable_text,
    refuse_unknown_pieces,
)
from xgr.engine.prompt_embeds import checked_spans, prompt_parts
from xgr.engine.results import PendingRecommendation, search_params
from xgr.engine.served_catalog import ServedCatalog, named_catalogs
from xgr.engine.spec import DecodeSpec
from xgr.engine.warm_up import capture_ahead, capture_lanes
from xgr.kernels.backend import select_attention_backend
from xgr.models import CausalLM, T5Seq2SeqLM
from xgr.models.sid_vocab import (
    validate_sid_token_ids,
)

logger = logging.getLogger(__name__)


# What recommend takes as a prompt: token ids, text, or an ``xgr.Prompt`` with embeddings.
PromptLike = Sequence[int] | str | Prompt


class Engine:
    """Serves recommendations from one model and one or several catalogs.

    Args:
        model: the decoder-only LM or the T5 encoder-decoder, already on its device and
            dtype; projections that read one input are fused in place
            (``fuse_projections``). On CUDA a T5 model's encoder and its decoder levels
            replay CUDA graphs, with Triton kernels for cross- and self-attention.
        catalog: the items served; or name -> catalog for several (markets, tenants), each
            with its own versions, device tables and rules, the first the default
            (``catalogs``). A single catalog is named ``"default"``.
        sid_token_ids: (num_levels, codebook_size) int array, vocabulary id of each code.
        tokenizer: optional ``tokenizers.Tokenizer`` for string prompts.
        name: model name reported by the server.
        prompt_format: how histories become prompts (default: the items' tokens alone).
        titles: item id -> title, copied into results (default: none).
        chat_template: formats chat messages as a prompt (``chat_prompt``; the model
            folder's, ``xgr.engine.model_folder.ChatTemplate``); None: no chat.
        training_record: the model folder's record of the catalog it was trained with
            (``ItemCatalog.write_model_metadata``), which catalog updates must agree with;
            None: updates are checked against the catalog they change.
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
            between batches. ``recommend`` is safe to call from ``max_in_flight`` (streams x depth)
            threads at once (the scheduler's ``max_inflight``).
        first_levels_together: where the beam holds every first-level code of the catalog,
            run level 1's forward inside the pass before it (decoder-only: a single
            request's prefill; T5: the decoder's first step), one pass over the weights
            instead of two; the results are the same. False runs every level after the
            one before.

    Raises:
        XgrError: the code map does not match the catalog or the model's vocabulary, or an
            option is out of its range (``full_vocab``, ``cuda_graphs`` and
            ``first_levels_together`` must be bools).
    """

    def __init__(
        self,
        model: CausalLM | T5Seq2SeqLM,
        catalog: ItemCatalog | Mapping[str, ItemCatalog],
        sid_token_ids: Any,
        tokenizer: Any = None,
        name: str = "xgr-model",
        prompt_format: PromptFormat | None = None,
        titles: dict[str, str] | None = None,
        chat_template: ChatTemplate | None = None,
        training_record: dict | None = None,
        full_vocab: bool = True,
        cuda_graphs: bool = True,
        cuda_streams: int = 1,
        pipeline_depth: int = 2,
        first_levels_together: bool = True,
    ) -> None:
        for option, value in (
            ("full_vocab", full_vocab),
            ("cuda_graphs", cuda_graphs),
            ("first_levels_together", first_levels_together),
        ):
            if not isinstance(value, bool):
                raise XgrError(f"{option} must be True or False, got {value!r}")
        model.fuse_projections()  # one GEMM where projections read the same input
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.prompt_format = prompt_format or PromptFormat()
        self.titles = titles or {}
        self.chat_template = chat_template
        self.training_record = training_record
        self.device = model.lm_head.weight.device
        catalogs = named_catalogs(catalog)
        first = next(iter(catalogs.values()))
        validate_sid_token_ids(sid_token_ids, first, model.config.vocab_size)
        # One code map for every catalog and version, each checked against it as built.
        self._sid_token_ids_host = np.asarray(sid_token_ids).astype(np.int64)
        self.attention_backend = select_attention_backend(self.device, model.shared_kv_layout[2])
        self._version_options = (full_vocab, self.attention_backend, first_levels_together)
        self._catalogs: dict[str, ServedCatalog] = {}
        self._preparing: list[DecodeSpec] = []  # versions capturing ahead (``_capture_ahead``)
        for name, items in catalogs.items():
            # Catalogs with the same first-level codes share the runner and its graphs.
            others = [c.current.spec for c in self._catalogs.values()]
            version = self._build_version(1, items, others[0] if others else None)
            self._catalogs[name] = ServedCatalog(name, version)
        self.default_catalog = next(iter(self._catalogs))
        cuda_streams = positive_int("cuda_streams", cuda_streams)
        pipeline_depth = positive_int("pipeline_depth", pipeline_depth)
        self._lanes = Lanes(self.runner, self.device, cuda_streams, pipeline_depth, cuda_graphs)
        if self.max_prompt_tokens < 1:
            raise XgrError(
                f"the model's prompt limit ({self.runner.prompt_limit}) is "
                f"{self.max_prompt_tokens}: it leaves no room for a prompt and "
                f"{first.num_levels} generated codes"
            )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        catalog: ItemCatalog | Mapping[str, ItemCatalog] | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        sid_token_ids: Any = None,
        quantization: str | None = None,
        **options: Any,
    ) -> Engine:
        """Load a model folder and serve ``catalog`` with it.

        Args:
            model_dir: HF folder with config.json and safetensors weights (single or sharded)
                of a Qwen2, Qwen3, Llama or T5 model (by config.json's ``model_type``).
            catalog: the catalog, or name -> catalog (``Engine``); default
                ``<model_dir>/catalog.index.json``. Each is checked against the folder's
                record of the catalog the model was trained with.
            device: "cpu" (the torch reference path) or "cuda" (Triton decode attention).
            dtype: "float32", "bfloat16" or "float16".
            sid_token_ids: (num_levels, codebook_size) code -> token id map; default found
                from the folder's tokenizer tokens named like the catalog's codes (``<a_12>``).
            quantization: None, "fp8" or "fp8-tensorwise": the decoder layers' projections
                in FP8 (e4m3), with one scale per output channel and per token ("fp8") or
                one per tensor for weights and activations ("fp8-tensorwise"); needs dtype
                "bfloat16" and, on CUDA, FP8 tensor cores (``xgr.models.quantize``). FP8
                checkpoints load either way (dequantized to ``dtype`` without it).
            options: ``full_vocab``, ``cuda_graphs``, ``cuda_streams``, ``pipeline_depth``
                and ``first_levels_together``, passed to ``Engine``.

        Raises:
            XgrError: unreadable folder or weights, no catalog, a catalog whose fingerprint
                differs from the one saved beside the model, or a code map that does not fit.
        """
        return load_engine(
            Path(model_dir), catalog, device, dtype, sid_token_ids,
            lambda **parts: cls(**parts, **options), quantization,
        )  # fmt: skip

    @property
    def catalogs(self) -> Mapping[str, ServedCatalog]:
        """The served catalogs by name, the default first (read-only)."""
        return MappingProxyType(self._catalogs)

    def served_catalog(self, name: str | None = None) -> ServedCatalog:
        """The catalog named ``name`` (None: the default).

        Raises:
            XgrError: no catalog of that name is served (the names listed).
        """
        if name is None:
            return self._catalogs[self.default_catalog]
        served = self._catalogs.get(name) if isinstance(name, str) else None
        if served is None:
            raise XgrError(
                f"no catalog named {str(name)[:64]!r}; this engine serves {list(self._catalogs)}"
            )
        return served

    @property
    def _current(self) -> CatalogVersion:
        return self._catalogs[self.default_catalog].current

    @property
    def catalog(self) -> ItemCatalog:
        """The default catalog (its current version)."""
        return self._current.catalog

    @property
    def catalog_version(self) -> int:
        """The default catalog's current version number (1 at start; ``update_catalog``)."""
        return self._current.version

    @property
    def decode_spec(self) -> DecodeSpec:
        return self._current.spec

    @property
    def runner(self):
        """The model family's runner over the default catalog (``xgr.runner``)."""
        return self._current.spec.runner

    @property
    def trie(self):
        """The default catalog's trie on the model's device."""
        return self._current.spec.trie

    @property
    def catalog_masks(self) -> CatalogMasks:
        return self._current.masks

    @property
    def title_index(self) -> TitleIndex:
        return self._current.title_index

    @property
    def sid_token_ids(self) -> torch.Tensor:
        """(num_levels, codebook_size) int64 vocabulary id of each code, on the model's
        device, as the default catalog's search reads it (-1: a code it cannot use)."""
        return self._current.spec.scorer.sid_token_ids

    def _build_version(
        self, number: int, catalog: ItemCatalog, previous: DecodeSpec | None = None
    ) -> CatalogVersion:
        """A catalog version's tables, its code map checked against it; its runner that
        of ``previous`` where they agree (``DecodeSpec.build``)."""
        table = validate_sid_token_ids(
            self._sid_token_ids_host, catalog, self.model.config.vocab_size
        )
        full_vocab, backend, together = self._version_options
        return CatalogVersion.build(
            number, catalog, self.model, torch.from_numpy(table).to(self.device), self.titles,
            full_vocab, backend, together, previous,
        )  # fmt: skip

    def update_catalog(
        self,
        add: dict[str, Any] | None = None,
        remove: Sequence[str] | None = None,
        set_attributes: dict[str, dict[str, Any]] | None = None,
        replace: ItemCatalog | None = None,
        catalog: str | None = None,
    ) -> int:
        """Serve a new version of a catalog: items added (item id -> semantic ID, as code
        tokens ``["<a_1>", "<b_2>", "<c_3>"]`` or ints), removed, attributes set, or the
        whole catalog replaced (``xgr.catalog.updates.CatalogUpdate``).

        The version's device tables are built here, off the request path; batches launched
        after this returns use it, batches launched before finish on theirs, and no batch
        mixes versions (each result names its ``catalog_version``). Thread-safe.

        Args:
            catalog: the catalog's name (None: the default).

        Returns:
            The new version's number.

        Raises:
            XgrError: an unknown catalog, a malformed update, or a catalog the model was
                not trained for (an item of the training catalog, or of the current one
                without a training record, with another semantic ID; other levels or
                codebook); nothing changes.
        """
        served = self.served_catalog(catalog)
        update = CatalogUpdate(add, remove, set_attributes, replace)

        def build(current: CatalogVersion, number: int) -> CatalogVersion:
            items = apply_update(current.catalog, update)
            # Kept items keep their codes: only added ones (or a whole replacement) can move.
            only = None if replace is not None else [str(i) for i in add or {}]
            if self.training_record is not None:
                items.check_compatible(self.training_record, "the model", only)
            else:
                items.check_compatible(
                    _record_of(current.catalog, only), "the catalog it replaces", only
                )
            version = self._build_version(number, items, current.spec)
            self._capture_ahead(version, current)
            return version

        version = served.publish(build)
        logger.info(
            "catalog %r version %d: %d items, %d semantic IDs",
            served.name, version.version, len(version.catalog), version.catalog.num_semantic_ids,
        )  # fmt: skip
        return version.version

    def rollback_catalog(self, catalog: str | None = None) -> int:
        """Serve the version of a catalog (None: the default) before its current one again
        (its number and tables).

        Returns:
            The version now served.

        Raises:
            XgrError: an unknown catalog, or no earlier version is kept.
        """
        served = self.served_catalog(catalog)
        version = served.rollback(self._capture_ahead)
        logger.info("catalog %r rolled back to version %d", served.name, version.version)
        return version.version

    @property
    def max_in_flight(self) -> int:
        """Batches this engine can have in flight at once: ``cuda_streams`` x
        ``pipeline_depth`` on CUDA, else 1 (the scheduler's ``max_inflight``)."""
        return self._lanes.capacity

    @property
    def graphs(self) -> CudaGraphs | None:
        """The first lane's CUDA graphs (None: eager)."""
        return self._lanes.lanes[0].graphs

    def release_graphs(self) -> None:
        """Drop every lane's CUDA graphs and prompt-KV pool, once the device is done with
        them; the next batches capture and allocate again (a benchmark's fresh start)."""
        for lane in self._lanes.lanes:
            if lane.graphs is not None:
                lane.graphs.release()

    @property
    def num_levels(self) -> int:
        """Codes in a semantic ID: the decode steps of every search."""
        return self.catalog.num_levels

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted (tokens).

        Decoder-only: positions must cover the generated codes too. T5: the config's
        ``max_prompt_tokens`` (the decoder has positions of its own).
        """
        return self.runner.max_prompt_tokens

    def history_prompt(
        self, history: Sequence[Any], truncate: bool = False, *, catalog: str | None = None
    ) -> list[int]:
        """The prompt (token ids) for a history of item ids, oldest first.

        Args:
            history: item ids of the catalog.
            truncate: drop the oldest items until the prompt fits the model; without it a
                prompt that is too long raises at ``recommend``.
            catalog: the catalog's name (None: the default).

        Raises:
            XgrError: empty history, unknown item ids, an unknown catalog, or ``truncate``
                not a bool.
        """
        if not isinstance(truncate, bool):
            raise XgrError(f"truncate must be True or False, got {truncate!r}")
        limit = self.max_prompt_tokens if truncate else None
        items = self.served_catalog(catalog).current.catalog
        return self.prompt_format.build(history, items, self._sid_token_ids_host, limit)

    def tokenize(self, prompt: Sequence[int] | str) -> list[int]:
        """A prompt as token ids, validated. Raises XgrError for an unusable prompt."""
        return self.token_ids(prompt).tolist()

    def chat_prompt(self, messages: list[dict]) -> str:
        """A conversation (OpenAI-style ``{"role": ..., "content": ...}`` messages) as the
        prompt text of the model folder's chat template, ready for the assistant's turn.

        Raises:
            XgrError: the folder has no chat template, or the template refuses the messages.
        """
        if self.chat_template is None:
            raise XgrError(
                "the model folder has no chat template (chat_template.jinja, or chat_template "
                "in tokenizer_config.json)"
            )
        return self.chat_template.format(messages)

    def prompt_input(self, prompt: PromptLike) -> tuple[np.ndarray, list]:
        """A prompt's token ids (``token_ids``) and its given input embeddings: checked
        (offset, (n, hidden_size) CPU tensor, its values fitting the model's dtype) spans,
        sorted by offset; none for a list of ids or a string.

        Raises:
            XgrError: an unusable prompt or span (naming it; ``xgr.Prompt``).
        """
        if not isinstance(prompt, Prompt):
            return self.token_ids(prompt), []
        ids, spans = prompt_parts(prompt)
        tokens = self.token_ids(ids)
        dtype = self.model.lm_head.weight.dtype
        return tokens, checked_spans(spans, tokens.size, self.runner.hidden_size, dtype)

    def token_ids(self, prompt: PromptLike) -> np.ndarray:
        """``tokenize`` as a new (tokens,) int64 NumPy array, the form the batch packing
        copies to the device. Callers that validate a prompt before queueing it (the server)
        keep this array: checking an array is many times cheaper than a list, whose
        element-by-element conversion would cost host time on every request. For an
        ``xgr.Prompt`` its token ids (placeholders where its embeddings go), its spans
        checked too (``prompt_input``).

        Raises:
            XgrError: an unusable prompt (``PromptTooLongError`` above the model's limit).
        """
        if isinstance(prompt, Prompt):
            return self.prompt_input(prompt)[0]
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
            raise PromptTooLongError(
                f"prompt of {tokens.size} tokens exceeds the model's limit of "
                f"{self.max_prompt_tokens} ({self.runner.prompt_limit})"
            )
        vocab = self.model.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise XgrError(f"prompt token ids must be in [0, {vocab})")
        return tokens.astype(np.int64, copy=False)

    def recommend(
        self,
        prompts: Sequence[PromptLike],
        beam_width: int = 64,
        top_k: int = 64,
        num_results: int | Sequence[int] = 10,
        exclude_item_ids: Sequence[Iterable[Any] | None] | None = None,
        allow_item_ids: Sequence[Iterable[Any] | None] | None = None,
        item_filter: Sequence[dict | None] | None = None,
        catalog: str | None = None,
    ) -> list[RecommendResult]:
        """Recommend items for each prompt, within each prompt's item rules.

        Args:
            prompts: token-id lists, or strings when the model folder has a tokenizer.
            beam_width: beams kept per decode step.
            top_k: candidates per beam per step.
            num_results: semantic IDs returned per prompt (one int, or one per prompt), best
                first; each brings all its items that pass the prompt's rules, so collisions
                can make ``items`` longer.
            exclude_item_ids: per prompt (or None), item ids never returned (e.g. the
                history).
            allow_item_ids: per prompt (or None), the only item ids that may be returned.
            item_filter: per prompt (or None), conditions on the catalog's item attributes
                (``ItemCatalog.load_attributes``; grammar in ``xgr.catalog.attributes``).
            catalog: the name of the catalog to recommend from (None: the default;
                ``catalogs``).

        The rules apply inside the search: a semantic ID is a candidate when one of its
        items passes, a prefix when a semantic ID below it is, so the results are those of
        the catalog restricted to the passing items. Item ids outside the catalog are
        ignored.

        Returns:
            One ``RecommendResult`` per prompt, in order.

        Raises:
            XgrError: bad search parameters, prompts (empty, out-of-vocab ids) or rules
                (not one entry per prompt; an unknown attribute, operator or a value of the
                wrong type in a filter), or an unknown catalog.
            PromptTooLongError: a prompt longer than ``max_prompt_tokens``.
            ModelOutputError: the model gave no finite score for a prompt.
        """
        return self.recommend_async(
            prompts, beam_width, top_k, num_results, exclude_item_ids, allow_item_ids,
            item_filter, catalog,
        ).result()  # fmt: skip

    def recommend_async(
        self,
        prompts: Sequence[PromptLike],
        beam_width: int = 64,
        top_k: int = 64,
        num_results: int | Sequence[int] = 10,
        exclude_item_ids: Sequence[Iterable[Any] | None] | None = None,
        allow_item_ids: Sequence[Iterable[Any] | None] | None = None,
        item_filter: Sequence[dict | None] | None = None,
        catalog: str | None = None,
    ) -> PendingRecommendation:
        """``recommend``, returning once the batch's device work is queued (on CUDA; on the
        CPU once it is done). Arguments and input errors as ``recommend``; blocks while
        ``max_in_flight`` batches are in flight.

        Returns:
            A ``PendingRecommendation``; its ``result()`` waits for the device and gives
            ``recommend``'s results (or raises its ``ModelOutputError``).
        """
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise XgrError("prompts must be a list of prompts")
        search, params = search_params(len(prompts), beam_width, top_k, num_results)
        served = self.served_catalog(catalog)
        version = served.current  # the batch's catalog version, from launch to result
        parts = each_prompt(prompts, self.prompt_input)
        tokenized = [tokens for tokens, _ in parts]
        spans = [s for _, s in parts] if any(s for _, s in parts) else None
        rules = request_rules(
            version.catalog, len(prompts), allow_item_ids, exclude_item_ids, item_filter
        )
        dtype = self.model.lm_head.weight.dtype
        if not tokenized:
            return PendingRecommendation(
                None, None, [], [], [], version.catalog, self.titles, dtype, version.version,
                served.name,
            )  # fmt: skip
        hold = self._lanes.take()
        try:
            pending = self._launch(hold.lane, version, tokenized, search, rules, spans)
        except BaseException:
            hold.release()
            raise
        if pending.events is None:  # the CPU: the work is done
            hold.release()
        else:
            hold.watch(pending.done)
        return PendingRecommendation(
            pending, hold, tokenized, params, rules, version.catalog, self.titles, dtype,
            version.version, served.name,
        )  # fmt: skip

    def _launch(
        self,
        lane: Lane,
        version: CatalogVersion,
        tokenized: list[np.ndarray],
        search: SearchParams,
        rules: list,
        spans: list | None = None,
    ):
        """Queue a batch on a lane (``Lanes.run``): its graphs planned for its catalog
        version's runner (a lane whose graphs were of another version drops them: a new
        version's batches capture again) and its trie masks built on the lane's stream while
        its prefill runs."""
        graphs, width, top_k = lane.graphs, search.beam_width, search.top_k
        spec = version.spec
        filtered = any(r.active for r in rules)
        lens = [len(t) for t in tokenized]

        runner = spec.runner
        plans = []  # planned once, by whichever of needs_capture and launch asks first

        def plan():
            if not plans:
                together = runner.first_levels_together(len(tokenized), width)
                plans.append(
                    graphs.plan(
                        lens,
                        width,
                        top_k,
                        together,
                        filtered=filtered,
                        embedded=spans is not None,
                        runner=runner,
                    )  # fmt: skip
                )
            return plans[0]

        def launch():
            masks = functools.partial(version.masks.masks, rules) if filtered else None
            if graphs is None:
                return launch_semantic_ids(spec, tokenized, width, top_k, None, EAGER, masks, spans)
            with graphs.lock:
                graphs.use(spec, self._served_specs())
                return launch_semantic_ids(
                    spec, tokenized, width, top_k, graphs, plan(), masks, spans
                )

        def needs_capture() -> bool:
            if graphs is None:
                return False
            return graphs.needs_capture(plan(), lens, spec)

        return self._lanes.run(lane, launch, needs_capture)

    def _served_specs(self) -> list[DecodeSpec]:
        """The catalogs' current versions' specs and those capturing ahead (whose graphs a
        lane keeps)."""
        return [served.current.spec for served in self._catalogs.values()] + self._preparing

    def _capture_ahead(self, version: CatalogVersion, current: CatalogVersion) -> None:
        """Before ``version`` replaces ``current``, capture the decode graphs that its
        batches will replay (``capture_ahead``): its first batches would otherwise capture
        them one after another, each holding every launch back. A failed capture is logged
        and left to the first batch."""
        if self.graphs is None:
            return
        self._preparing.append(version.spec)
        try:
            captured = capture_ahead(version.spec, current.spec, self._lanes, self._served_specs)
            logger.info("captured %d graphs ahead of catalog version %d", captured, version.version)
        except RuntimeError as exc:  # CUDA errors and out of memory
            logger.warning("capturing ahead of catalog version %d failed: %s", version.version, exc)
        finally:
            self._preparing.remove(version.spec)

    def warm_up(
        self,
        prompt_tokens: int,
        beam_width: int,
        top_k: int,
        max_batch_size: int,
        spread: float = 0.2,
    ) -> int:
        """Capture, on every lane and for every catalog, the CUDA graphs that batches of
        such requests replay.

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
        if self.graphs is None:  # the CPU, or no graphs
            return 0
        # Longer prompts are refused at admission: no batch of them needs a graph.
        longest = min(int(prompt_tokens * (1 + spread)), self.max_prompt_tokens)
        shortest = max(1, int(prompt_tokens * (1 - spread)))
        batches = (shortest, longest, max_batch_size)
        captured = 0
        live = self._served_specs()
        for spec in live:
            for lane in self._lanes.lanes:
                with lane.graphs.lock:
                    lane.graphs.use(spec, live)
            captured += capture_lanes(spec, self._lanes.lanes, batches, beam_width, top_k)
        return captured


def _record_of(catalog: ItemCatalog, items: list[str] | None) -> dict:
    """``catalog.model_record()``, of only ``items`` where given (an update's added items:
    a record of a million items takes seconds)."""
    if items is None:
        return catalog.model_record()
    record = {
        "num_levels": catalog.num_levels,
        "codebook_size": catalog.codebook_size,
        "level_names": list(catalog.level_names),
    }
    rows = [catalog.item_index.get(i) for i in items]
    record["items"] = {
        i: catalog.codes[r].tolist() for i, r in zip(items, rows, strict=True) if r is not None
    }
    return record
