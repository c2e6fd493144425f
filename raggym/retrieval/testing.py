"""Test doubles for retrieval: a deterministic, model-free embedder.

``HashingEmbedder`` maps each lower-cased word to a fixed random direction (seeded by the word's
hash) and sums them, so texts that share words have high cosine similarity. It needs no model
download and encodes thousands of texts per second, which keeps unit tests of indexes, graphs
and environments fast and reproducible. It is not a semantic model.
"""

from __future__ import annotations

import hashlib
import re
from typing import Sequence

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    def __init__(self, dim: int = 64, name: str = "hashing-bow"):
        self.dim = int(dim)
        self.name = name
        self.spec = name
        self.max_length = 0
        self._cache: dict[str, np.ndarray] = {}

    def _word_vector(self, word: str) -> np.ndarray:
        vec = self._cache.get(word)
        if vec is None:
            seed = int.from_bytes(hashlib.sha1(word.encode("utf-8", "surrogatepass")).digest()[:8], "little")
            vec = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            self._cache[word] = vec
        return vec

    def encode(self, texts: Sequence[str], *, batch_size: int = 64, sort_by_length: bool = True,
               show_progress: bool = False, desc: str = "encoding") -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in _WORD.findall(str(text).lower()):
                out[i] += self._word_vector(word)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out[norms[:, 0] == 0, 0] = 1.0  # a text without words still gets a unit vector
        norms[norms == 0] = 1.0
        return out / norms
