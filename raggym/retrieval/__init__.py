"""Retrieval: dense passages (FAISS, exact sharding), HippoRAG 2-style graph (batched PPR), hybrid RRF.

The public entry point is ``Retriever`` (build, save, load, retrieve). The building blocks are
importable on their own for the Ray layer and for tests: ``DenseIndex``/``merge_topk`` (one
shard per actor), ``KnowledgeGraph``, ``TorchPPR``/``IgraphPPR``, ``rrf_fuse``.
"""

from .base import MODES, Hit, QueryResult, check_mode
from .dense import DenseConfig, DenseIndex, merge_topk
from .encoding import EmbeddingCache, encode_texts, passage_text
from .graph import GraphConfig, KnowledgeGraph, normalize_phrase
from .hybrid import rrf_fuse
from .openie_io import OpenIEAlignment, PassageTriples, align_openie, openie_docs
from .ppr import CSRGraph, IgraphPPR, PPRResult, TorchPPR, top_k_rows
from .retriever import Retriever, RetrieverConfig, ensure_index
from .storage import IndexFormatError

__all__ = [
    "CSRGraph",
    "DenseConfig",
    "DenseIndex",
    "EmbeddingCache",
    "GraphConfig",
    "Hit",
    "IgraphPPR",
    "IndexFormatError",
    "KnowledgeGraph",
    "MODES",
    "OpenIEAlignment",
    "PPRResult",
    "PassageTriples",
    "QueryResult",
    "Retriever",
    "RetrieverConfig",
    "TorchPPR",
    "align_openie",
    "check_mode",
    "encode_texts",
    "ensure_index",
    "merge_topk",
    "normalize_phrase",
    "openie_docs",
    "passage_text",
    "rrf_fuse",
    "top_k_rows",
]
