"""The embedded demo: a small generative recommender trained on MovieLens-100K.

``build_demo`` downloads MovieLens-100K (once), derives semantic IDs by residual k-means
over collaborative item embeddings, trains a small Qwen2 decoder on the users'
semantic-ID sequences and writes a model folder ``xgr.Engine.from_pretrained`` can serve.
``evaluate_demo`` scores it leave-one-out against a most-popular baseline. The training
stack (transformers, scikit-learn) is imported only when a model has to be built.
"""

from xgr.demo.build import (
    CATALOG_INDEX_FILE,
    DEMO_METADATA_FILE,
    ITEMS_FILE,
    build_demo,
    load_demo_catalog,
    read_demo_metadata,
)
from xgr.demo.config import DemoConfig
from xgr.demo.evaluate import demo_cases, evaluate_demo
from xgr.demo.movielens import LeaveOneOut, MovieLensData, leave_one_out, load_movielens
from xgr.training.evaluate import popularity_ranking

__all__ = [
    "CATALOG_INDEX_FILE",
    "DEMO_METADATA_FILE",
    "ITEMS_FILE",
    "DemoConfig",
    "LeaveOneOut",
    "MovieLensData",
    "build_demo",
    "demo_cases",
    "evaluate_demo",
    "leave_one_out",
    "load_demo_catalog",
    "load_movielens",
    "popularity_ranking",
    "read_demo_metadata",
]
