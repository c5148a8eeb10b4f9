"""The demo's build settings."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

from xgr.core import XgrError
from xgr.training.loop import TrainSettings
from xgr.training.models import ModelShape

# Bump when the build's output changes for an unchanged config, so old caches are rebuilt.
BUILD_FORMAT_VERSION = 1
# The demo's model architectures: a Qwen2 decoder-only LM, or a TIGER-style T5
# encoder-decoder whose vocabulary is the special tokens and the codes alone.
ARCHITECTURES = ("qwen2", "t5")
DEFAULT_ARCH = "qwen2"
# Where the T5 default differs from the Qwen2 one (``DemoConfig.for_arch("t5")``). A T5
# example teaches one item per encoder pass over its whole prompt, where a Qwen2 window
# teaches every item it holds, so an epoch of the ~98k T5 pairs would take about 20 minutes
# on 2 CPU cores: 1,000 steps of 32 pairs (a third of them) take about 4 at the 4 steps/s
# measured on idle cores.
T5_DEFAULTS: dict[str, object] = {
    "num_kv_heads": 4,
    "epochs": 1,
    "max_steps": 1000,
    "warmup_steps": 100,
}


@dataclass(frozen=True)
class DemoConfig:
    """Everything that decides the demo model; a changed field means a new cached model.

    The defaults train in about 2.5 minutes on 2 idle CPU cores (565 steps) and, leave-one-out on
    all 943 users with beam width 64, reach Recall@10 0.157 / NDCG@10 0.083 against 0.086 /
    0.045 for most-popular (see ``evaluate_demo``).

    Attributes:
        arch: "qwen2" (decoder-only) or "t5" (encoder-decoder); see ``for_arch`` for each
            one's default settings.
        num_levels: semantic-ID levels.
        codebook_size: codes per level.
        embedding_dim: SVD components of the item embeddings that are quantized.
        max_history: items of history in a prompt (the most recent ones).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: the model's
            shape. Qwen2: num_kv_heads < num_heads is grouped-query attention. T5:
            hidden_size is d_model, num_layers the layers of the encoder and of the decoder
            each, intermediate_size d_ff, head size hidden_size / num_heads; num_kv_heads
            must equal num_heads (T5 has no grouped-query attention).
        epochs: passes over the training examples (Qwen2: windows of a user's sequence;
            T5: one (history, next item) pair per training interaction).
        max_steps: stop after this many optimizer steps (None: run every epoch).
        batch_size: training examples per step.
        learning_rate: AdamW peak learning rate (linear warm-up, cosine decay to 10%).
        weight_decay: AdamW decoupled weight decay.
        warmup_steps: linear warm-up steps.
        seed: seeds the SVD, k-means, weight init and batch order.
    """

    arch: str = DEFAULT_ARCH
    num_levels: int = 3
    codebook_size: int = 32
    embedding_dim: int = 64
    max_history: int = 50
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    epochs: int = 5
    max_steps: int | None = None
    batch_size: int = 32
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise XgrError(
                f"DemoConfig.arch must be one of {list(ARCHITECTURES)}, got {self.arch!r}"
            )
        positive = (
            "num_levels",
            "codebook_size",
            "embedding_dim",
            "max_history",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "epochs",
            "batch_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise XgrError(f"DemoConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise XgrError(f"DemoConfig.max_steps must be None or >= 1, got {self.max_steps}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise XgrError(
                "DemoConfig: hidden_size must be a multiple of num_heads, and num_heads of "
                f"num_kv_heads (got {self.hidden_size}, {self.num_heads}, {self.num_kv_heads})"
            )
        if self.arch == "t5" and self.num_kv_heads != self.num_heads:
            raise XgrError(
                "DemoConfig: a t5 model has no grouped-query attention: num_kv_heads must "
                f"equal num_heads (got {self.num_kv_heads} and {self.num_heads})"
            )
        if not self.learning_rate > 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise XgrError("DemoConfig: learning_rate must be > 0, weight_decay and warmup >= 0")

    @classmethod
    def for_arch(cls, arch: str = DEFAULT_ARCH) -> DemoConfig:
        """The default demo configuration of an architecture ("qwen2" or "t5").

        Raises:
            XgrError: an unknown architecture.
        """
        if arch == "t5":
            return cls(arch="t5", **T5_DEFAULTS)
        return cls(arch=arch)

    @classmethod
    def quick(cls, arch: str = DEFAULT_ARCH) -> DemoConfig:
        """A tiny configuration for tests: builds in seconds, quality is not the point."""
        return cls(
            arch=arch,
            codebook_size=8,
            embedding_dim=16,
            max_history=8,
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            num_kv_heads=2 if arch == "t5" else 1,
            intermediate_size=64,
            epochs=1,
            max_steps=20,
            batch_size=32,
            warmup_steps=5,
        )

    def shape(self) -> ModelShape:
        """The model's size (no dropout)."""
        return ModelShape(
            self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads,
            self.intermediate_size,
        )  # fmt: skip

    def training(self) -> TrainSettings:
        """The training loop's settings (on the CPU, float32)."""
        return TrainSettings(
            batch_size=self.batch_size,
            epochs=self.epochs,
            max_steps=self.max_steps,
            learning_rate=self.learning_rate,
            weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps,
            seed=self.seed,
            desc=f"training demo model ({self.arch})",
        )

    def with_changes(self, **changes: object) -> DemoConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    @property
    def cache_key(self) -> str:
        """12 hex digits identifying this config and the build format."""
        fields = self.to_dict()
        if self.arch == DEFAULT_ARCH:
            # Qwen2 keys are those of the configs before ``arch`` existed, so the models
            # already cached stay valid; any other arch is part of the key.
            del fields["arch"]
        text = json.dumps({"v": BUILD_FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]
