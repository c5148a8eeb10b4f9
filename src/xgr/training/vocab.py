"""The demo model's vocabulary, tokenizer and prompt format.

Vocabulary layout (ids are fixed by the catalog's shape alone):

- 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>`` (never seen in training; it only keeps
  the tokenizer from failing on stray words),
- then one token per code per level: ``<a_0>`` .. ``<a_{C-1}>``, ``<b_0>`` .., so code ``c``
  of level ``l`` has id ``4 + l * C + c``.

A prompt is ``<bos>`` followed by the semantic-ID tokens of the user's last ``max_history``
items, oldest first (written to the model folder as its ``xgr_prompt.json``); the model then
generates the next item's ``num_levels`` code tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from xgr.catalog import ItemCatalog

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
FIRST_CODE_ID = len(SPECIAL_TOKENS)


def vocabulary(catalog: ItemCatalog) -> list[str]:
    """All tokens in id order: the special tokens, then each level's code tokens."""
    codes = [
        f"<{name}_{code}>" for name in catalog.level_names for code in range(catalog.codebook_size)
    ]
    return [*SPECIAL_TOKENS, *codes]


def sid_token_ids(catalog: ItemCatalog) -> np.ndarray:
    """Vocabulary ids of the code tokens.

    Returns:
        int64 array (num_levels, codebook_size); entry ``[l, c]`` is the id of code ``c`` of
        level ``l`` (``<a_c>`` for level 0).
    """
    levels, size = catalog.num_levels, catalog.codebook_size
    return FIRST_CODE_ID + np.arange(levels * size, dtype=np.int64).reshape(levels, size)


def build_tokenizer(catalog: ItemCatalog) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``vocabulary(catalog)``.

    Every token is also an *added token*, so ``"<a_1><b_2><c_3>"`` splits without spaces
    and ``"<bos> <a_1> <b_2> <c_3>"`` gives the same ids after ``<bos>``. No special tokens
    are added automatically: the prompt builder writes ``<bos>`` itself.
    """
    from transformers import PreTrainedTokenizerFast  # heavy: only when building a model

    vocab = vocabulary(catalog)
    backend = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False) for t in vocab[FIRST_CODE_ID:]])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )
