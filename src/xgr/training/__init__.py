"""From a catalog and interactions to a served model: semantic IDs (``semantic_ids``),
interaction files and their splits (``interactions``), training (``recommender``, over
``models``, ``examples`` and ``loop``), the model folder (``folder``) and offline evaluation
(``evaluate``). The training stack (transformers, scikit-learn) is imported by the modules
that need it, not by this package."""
