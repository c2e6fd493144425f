"""``UnicodeText``: a Gymnasium ``Text`` space for natural-language observations and actions.

``gymnasium.spaces.Text`` tests membership character by character against a finite charset. Real
prompts, passages and model output use the whole of Unicode, and a charset holding every code
point would cost tens of megabytes per space. ``UnicodeText`` keeps a small printable charset for
``sample()`` but admits any string of the right length in ``contains()``, optionally refusing
lone surrogates (which cannot be encoded as UTF-8 and so can never reach a tokenizer).

It is still a ``Text`` subclass, so Gymnasium's vector utilities (``batch_space``,
``concatenate``) treat it like any other text space.
"""

from __future__ import annotations

import re
import string
from typing import Any

from gymnasium.spaces import Text

# What sample() draws from: printable ASCII plus a few common non-ASCII characters, so that
# random actions exercise the parsers on more than ASCII.
SAMPLE_CHARSET = (
    string.ascii_letters + string.digits + string.punctuation + " \n\t" + "éèüößçñ–—‘’“”…°€中文"
)

_SURROGATE_RE = re.compile("[\ud800-\udfff]")


class UnicodeText(Text):
    def __init__(
        self,
        max_length: int,
        *,
        min_length: int = 0,
        allow_surrogates: bool = False,
        charset: str = SAMPLE_CHARSET,
        seed: Any = None,
    ):
        super().__init__(max_length=max_length, min_length=min_length, charset=charset, seed=seed)
        self.allow_surrogates = allow_surrogates

    def contains(self, x: Any) -> bool:
        if not isinstance(x, str) or not (self.min_length <= len(x) <= self.max_length):
            return False
        return self.allow_surrogates or _SURROGATE_RE.search(x) is None

    def __repr__(self) -> str:
        return (
            f"UnicodeText({self.min_length}, {self.max_length}, "
            f"allow_surrogates={self.allow_surrogates})"
        )

    def __eq__(self, other: Any) -> bool:
        return (
            isinstance(other, UnicodeText)
            and super().__eq__(other)
            and self.allow_surrogates == other.allow_surrogates
        )

    __hash__ = None  # mutable rng state, like every Gymnasium space
