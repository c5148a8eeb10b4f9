"""Input embeddings given for some prompt positions, spliced over the token embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptEmbeds:
    """The packed prompt positions whose input embeddings are given.

    Attributes:
        source: (T,) int64 for each packed prompt token (a graph: each padded one), the row
            of ``values`` that replaces its token embedding, or -1 to keep it.
        values: (S, hidden_size) model-dtype embeddings (a graph: a fixed-capacity buffer
            whose rows past the batch's are never read).
    """

    source: torch.Tensor
    values: torch.Tensor

    def splice(self, embedded: torch.Tensor) -> torch.Tensor:
        """``embedded`` with the given rows in place of the token embeddings.

        A gather and a select over the packed rows, with no host synchronization and fixed
        shapes (CUDA graphs).

        Args:
            embedded: (N, hidden_size) token embeddings of the packed tokens, N >= T (rows
                past T, such as level 1's code rows, are kept).

        Returns:
            (N, hidden_size) in ``embedded``'s dtype.
        """
        num = self.source.shape[0]
        given = self.values.index_select(0, self.source.clamp(min=0))
        head = torch.where((self.source >= 0)[:, None], given, embedded[:num])
        return head if num == embedded.shape[0] else torch.cat((head, embedded[num:]))
