"""Hugging Face transformers engine: batched sampling with a KV cache, on CPU or GPU.

It runs its own decode loop instead of ``model.generate`` because the rollout loop needs three
things ``generate`` does not give directly: the log-probability of every sampled token under the
distribution it was actually drawn from, a per-prompt random stream (so a seed reproduces a
prompt's sample whatever else is in the batch), and stop strings that end the continuation at the
exact token that completed them, with the sampled ids kept as they are.

The loop:

1. left-pad the prompts (padding never sits between a prompt and its continuation), with
   ``position_ids`` counted over real tokens only, and prefill the cache in one forward pass;
2. each step: scale the last logits by ``1/temperature``, apply top-k and top-p, take
   ``log_softmax`` (these are the reported logprobs), and sample by inverse CDF with one uniform
   number from the prompt's own generator, which draws exactly from ``p``;
3. a prompt finishes on an EOS id, on a stop string newly present in its decoded continuation,
   or at ``max_new_tokens``; finished prompts are dropped from the batch and from the KV cache,
   so long stragglers do not pay for short ones.

Stop strings are matched in ``tokenizer.decode(ids, skip_special_tokens=False)`` of the
continuation (not the prompt), checking only the last few tokens each step: a stop string of
``n`` UTF-8 bytes is covered by at most ``n`` tokens, and a margin of 4 tokens keeps partial
characters and leading-space handling at the window's edge from hiding a match.

Sessions (``generate_async``, the ``SessionEngine`` interface of ``actors.engines.base``): a
background scheduler thread serves requests from any number of sessions with continuous
batching. Between two decode steps it admits the requests that arrived (each is prefilled on its
own, so no padding ever enters a prefill) and drops the ones that finished. The running rows
share one left-padded KV cache with per-row ``position_ids``, the same layout ``generate`` uses,
so a row's logits are those of its unpadded context. When a request finishes, its row of the KV
cache (without the padding) is kept as the session's cache; the session's next request, whose
context extends the cached ids, prefills only the new suffix (an observation). A context that
diverges from the cache reuses the common prefix (keys and values of a prefix depend on that
prefix only), and a weight update drops every session cache.

Shared prompts (the prefix cache of vLLM, for GRPO's groups): the G samples of a question open
G sessions with the same prompt. Requests admitted together with identical contexts are prefilled
once and their rows copied; and the keys and values of every context computed without a
session's own cache (a session's first) are kept in a small shared store, so a new session that
starts with a stored context (or a prefix of one) prefills only what follows it. A weight update drops the store with the session caches.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import torch

from actors.engines.base import GenerationResult, SamplingParams, check_prompts, derive_seed
from actors.weight_sync import WeightSyncGroup, named_tensors_of

_STOP_WINDOW_MARGIN = 4
_IDLE_EXIT_S = 2.0  # the scheduler thread exits after this long without work (restarted on demand)
_SHARED_CONTEXTS = 64  # first contexts kept for other sessions (a step's distinct prompts, with room)


def _eos_ids(model, tokenizer, extra: Sequence[int] | None) -> set[int]:
    ids: set[int] = set(int(i) for i in (extra or ()))
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.update(int(i) for i in (source if isinstance(source, (list, tuple)) else [source]))
    return ids


def process_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution to sample from: ``[batch, vocab]`` float32.

    temperature scaling, then top-k, then top-p (nucleus; the most likely token is always kept),
    then ``log_softmax`` so the kept tokens are renormalised. Greedy returns ``log_softmax(logits)``.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / sampling.temperature  # z / T
    if sampling.top_k > 0 and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
        drop_sorted = mass_before >= sampling.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


# ---------------------------------------------------------------------------- sessions


@dataclass
class _SessionCache:
    """A finished request's keys and values: ``kv[layer] = (keys, values)``, each
    ``[1, kv_heads, len(tokens), head_dim]``, for exactly ``tokens``, computed with ``weight_version``."""

    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    weight_version: int


class _SessionRequest:
    """One ``generate_async`` call while the scheduler works on it."""

    def __init__(self, session_id, context, sampling, stop_strings, max_new_tokens, loop, future, device):
        self.session_id = session_id
        self.context = context
        self.sampling = sampling
        self.stop_strings = [s for s in stop_strings if s]
        self.window = max((len(s.encode("utf-8")) for s in self.stop_strings), default=0) + _STOP_WINDOW_MARGIN
        self.max_new_tokens = max_new_tokens
        self.loop, self.future = loop, future
        self.generator = None
        if sampling.seed is not None and not sampling.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(derive_seed(sampling.seed, 0))
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish, self.stop_string = "length", None
        self.cached: list[int] = []  # the ids whose keys/values this request's cache row holds
        self.pending = -1  # the last sampled id, fed to the next decode step
        self.weight_version = 0
        self.cancelled = False
        self.shareable = False  # its context owes nothing to its session's own cache: other sessions may reuse it

    @property
    def sampling_key(self) -> tuple:
        s = self.sampling
        return (s.temperature, s.top_p, s.top_k, s.logprobs_mode)


def _deliver(request: _SessionRequest, result=None, error: BaseException | None = None) -> None:
    def settle():
        if request.future.done():  # the caller was cancelled
            return
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)

    try:
        request.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


_SPARE_POSITIONS = 64  # room a cache layer keeps for coming tokens, so a decode step writes in place
_SPARE_LEAD = 64  # room before the first column, so a joining row longer than the batch fits without a copy


@functools.lru_cache(maxsize=None)
def _growing_layer_class():  # built on first use: transformers is imported lazily
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """``DynamicLayer`` whose ``keys``/``values`` are views ``buffer[:rows, :, start:end]`` of a
        larger zero-initialised buffer, so the running batch changes without copying all of it:

        - ``update`` writes new keys and values into the spare columns after ``end`` (concatenating
          the whole cache at every step cost about a third of a decode step at 16 rows x 600
          positions on CPU);
        - ``append_rows`` copies only the joining rows into spare rows;
        - ``move_rows`` fills the holes of finished rows with rows from the end and shrinks the view.

        When other code replaces ``keys``/``values`` (``batch_select_indices``, a gather), the next
        call copies them into a new buffer once. Columns outside a row's context hold zeros or an
        earlier row's finite values; the attention mask hides them (they must be finite: a masked
        score's weight is 0, and ``0 * nan`` is not)."""

        def _is_view(self) -> bool:
            buffer = getattr(self, "_buffer", None)
            if buffer is None or not self.keys.numel():
                return False
            rows, start = self.keys.shape[0], self._start
            return all(rows <= room.shape[0] and view.data_ptr() == room[:rows, :, start:].data_ptr()
                       and view.shape[1] == room.shape[1]
                       and view.stride() == room.stride() and start + view.shape[2] <= room.shape[2]
                       for view, room in zip((self.keys, self.values), buffer))

        def _reserve(self, rows: int, lead: int, tail: int) -> None:
            """A new buffer with ``rows`` rows and ``lead``/``tail`` free columns around the current
            keys and values, which are copied in. It is not zeroed (first touches of a large zeroed
            buffer cost more than the copy): ``append_rows`` zeroes what a row's mask hides."""
            b, h, n, _ = self.keys.shape
            self._buffer = tuple(t.new_empty((max(rows, b), h, lead + n + tail, t.shape[3]))
                                 for t in (self.keys, self.values))
            for room, t in zip(self._buffer, (self.keys, self.values)):
                room[:b, :, lead : lead + n] = t
            self._start = lead
            self._set_view(b, n)

        def _set_view(self, rows: int, width: int) -> None:
            end = self._start + width
            self.keys, self.values = (room[:rows, :, self._start : end] for room in self._buffer)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            add = key_states.shape[-2]
            if not self.keys.numel():
                self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
                self._reserve(key_states.shape[0], 0, add + _SPARE_POSITIONS)
            elif not (self._is_view() and self._start + self.keys.shape[2] + add <= self._buffer[0].shape[2]):
                self._reserve(self.keys.shape[0], 0, add + _SPARE_POSITIONS)
            rows, n = self.keys.shape[0], self.keys.shape[2]
            end = self._start + n
            self._buffer[0][:rows, :, end : end + add] = key_states
            self._buffer[1][:rows, :, end : end + add] = value_states
            self._set_view(rows, n + add)
            return self.keys, self.values

        def append_rows(self, keys: torch.Tensor, values: torch.Tensor, row_room: int) -> None:
            """Add rows whose (left-padded) keys and values end at this layer's last column; the
            batch widens on the left when they are longer. ``row_room``: rows a new buffer holds."""
            if not self.is_initialized:
                self.lazy_initialization(keys, values)
            b, n = (self.keys.shape[0], self.keys.shape[2]) if self.keys.numel() else (0, 0)
            k, width = keys.shape[0], keys.shape[2]
            grow = max(0, width - n)
            if not b:
                self.keys, self.values = keys[:0, :, :0], values[:0, :, :0]
                self._reserve(max(row_room, k), grow + _SPARE_LEAD, _SPARE_POSITIONS)
            elif not (self._is_view() and b + k <= self._buffer[0].shape[0] and grow <= self._start):
                self._reserve(max(row_room, b + k), grow + _SPARE_LEAD, _SPARE_POSITIONS)
            self._start -= grow
            end = self._start + max(n, width)
            for room, t in zip(self._buffer, (keys, values)):
                room[:b, :, self._start : self._start + grow] = 0  # new padding columns of the batch's rows
                room[b : b + k, :, self._start : end - width] = 0  # and of the joining rows
                room[b : b + k, :, end - width : end] = t
            self._set_view(b + k, max(n, width))

        def move_rows(self, moves: list[tuple[int, int]], rows: int, lead: int) -> None:
            """Copy row ``src`` onto row ``dst`` for each move, keep the first ``rows`` rows, and drop
            ``lead`` columns on the left (padding in every kept row)."""
            n = self.keys.shape[2]
            if not self._is_view():
                self._reserve(self.keys.shape[0], 0, _SPARE_POSITIONS)
            end = self._start + n
            if moves:
                src = torch.tensor([m[0] for m in moves], dtype=torch.long, device=self.keys.device)
                dst = torch.tensor([m[1] for m in moves], dtype=torch.long, device=self.keys.device)
                for room in self._buffer:
                    room[:, :, self._start : end].index_copy_(0, dst, room[:, :, self._start : end].index_select(0, src))
            self._start += lead
            self._set_view(rows, n - lead)

    return GrowingLayer


def new_kv_cache(config):
    """A ``DynamicCache`` for ``config`` whose full-attention layers grow in place (``GrowingLayer``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        layer_class = _growing_layer_class()
        cache.layers = [layer_class() for _ in cache.layers]
    return cache


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _select_rows(cache, mask: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Keep rows ``keep`` of a left-padded cache (in place) and its mask, dropping the columns that
    are padding in every kept row; returns the new mask."""
    index = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, index)
    lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)[:, :, lead:]
        layer.values = layer.values.index_select(0, index)[:, :, lead:]
    return mask[:, lead:]


class _SessionScheduler:
    """Continuous batching over sessions for one ``HFEngine`` (see the module docstring).

    Threads: callers (any event loop) enqueue requests and await asyncio futures; one scheduler
    thread runs every forward pass and settles the futures on the callers' loops. ``model_lock``
    serialises the model between the scheduler, ``HFEngine.generate`` and weight updates. State
    shared with callers (queue, session caches, counters) is guarded by ``self._cond``.
    """

    def __init__(self, engine: "HFEngine", *, session_cache_tokens: int, max_running: int):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.engine = engine
        self.session_cache_tokens = int(session_cache_tokens)
        self.max_running = int(max_running)
        self.model_lock = threading.RLock()
        self._cond = threading.Condition()
        self._waiting: deque[_SessionRequest] = deque()
        self._caches: OrderedDict[str, _SessionCache] = OrderedDict()  # least recently used first
        self._open: set[str] = set()
        self._busy: set[str] = set()  # sessions with a request in flight
        self._updating = 0
        self._in_step = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # prefill_tokens: ids run through the model in prefills; reused_tokens: ids taken from a
        # session's own cache; shared_tokens: ids taken from another session (the shared store, or
        # an identical request prefilled in the same forward)
        self._counters = {"prefill_tokens": 0, "reused_tokens": 0, "shared_tokens": 0, "prefill_forwards": 0,
                          "decode_steps": 0, "requests": 0}
        self._shared: OrderedDict[tuple, _SessionCache] = OrderedDict()  # first contexts of sessions, LRU first
        self._supported: bool | None = None
        # the running batch (touched by the scheduler thread only)
        self._rows: list[_SessionRequest] = []
        self._batch = None  # DynamicCache, left-padded to self._attention's width
        self._attention: torch.Tensor | None = None

    # ------------------------------------------------------------------ caller side

    def _check_supported(self) -> None:
        if self._supported is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer

            layers = DynamicCache(config=self.engine.model.config).layers
            self._supported = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
        if not self._supported:
            raise NotImplementedError(
                f"session generation keeps full-attention KV caches; {type(self.engine.model).__name__} uses other "
                "cache layers (sliding window, recurrent state). Use HFEngine.generate for this model.")

    async def submit(self, session_id, context_token_ids, sampling, stop_strings, max_new_tokens) -> GenerationResult:
        (context,) = check_prompts([context_token_ids], max_new_tokens)
        self._check_supported()
        loop = asyncio.get_running_loop()
        request = _SessionRequest(session_id, context, sampling, stop_strings, int(max_new_tokens), loop,
                                  loop.create_future(), self.engine.device)
        with self._cond:
            if self._closed:
                raise RuntimeError("this engine was closed")
            if session_id in self._busy:
                raise RuntimeError(f"session {session_id!r} already has a request in flight; a session's turns "
                                   "are sequential, await the previous one first")
            self._busy.add(session_id)
            self._open.add(session_id)
            self._waiting.append(request)
            self._counters["requests"] += 1
            self._ensure_thread()
            self._cond.notify_all()
        try:
            return await request.future
        except asyncio.CancelledError:
            with self._cond:
                request.cancelled = True
                self._cond.notify_all()
            raise

    def end(self, session_id: str) -> None:
        with self._cond:
            self._open.discard(session_id)
            self._caches.pop(session_id, None)

    def load(self) -> dict:
        with self._cond:
            return {"sessions": len(self._open), "running": len(self._busy)}

    def stats(self) -> dict:
        with self._cond:
            return {**self._counters, "cached_tokens": sum(len(c.tokens) for c in self._caches.values()),
                    "shared_contexts": len(self._shared)}

    def drop_caches(self) -> None:
        with self._cond:
            self._caches.clear()
            self._shared.clear()

    def paused_for_update(self):
        """Context manager: hold new requests back, let the running ones finish, then hold the model."""
        scheduler = self

        class _Pause:
            def __enter__(self):
                with scheduler._cond:
                    scheduler._updating += 1
                    while scheduler._rows or scheduler._in_step:
                        scheduler._cond.wait()
                scheduler.model_lock.acquire()

            def __exit__(self, *exc):
                scheduler.model_lock.release()
                with scheduler._cond:
                    scheduler._updating -= 1
                    if scheduler._waiting:
                        scheduler._ensure_thread()
                    scheduler._cond.notify_all()
                return False

        return _Pause()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
        for request in waiting:
            _deliver(request, error=RuntimeError("the engine was closed before this request started"))

    def _ensure_thread(self) -> None:  # called with self._cond held
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="hf-session-scheduler", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ scheduler thread

    def _serve(self) -> None:
        while True:
            with self._cond:
                idle_since = time.monotonic()
                while not self._rows and (self._updating or not self._waiting):
                    left = _IDLE_EXIT_S - (time.monotonic() - idle_since)
                    if self._closed or left <= 0:
                        self._thread = None
                        return
                    self._cond.wait(left)
                admit = []
                while not self._updating and self._waiting and len(self._rows) + len(admit) < self.max_running:
                    admit.append(self._waiting.popleft())
                self._in_step = True
            try:
                with self.model_lock, torch.inference_mode():
                    self._step(admit)
            finally:
                with self._cond:
                    self._in_step = False
                    self._cond.notify_all()

    def _step(self, admit: list[_SessionRequest]) -> None:
        self._step_admissions(admit)
        if not self._rows:
            return
        try:
            self._decode()
        except Exception as exc:  # noqa: BLE001 - a failed batch step fails every request in it
            rows, self._rows, self._batch, self._attention = self._rows, [], None, None
            for request in rows:
                self._finish(request, None, error=exc)

    def _take_cache(self, request: _SessionRequest) -> tuple[list | None, int, bool]:
        """The cached ``(keys, values)`` per layer that ``request.context`` can reuse most of, how
        many of its ids that is (``0``: none), and whether they come from another session (the
        shared store of first contexts) rather than the session's own cache."""
        version = self.engine.weight_version
        with self._cond:
            own = self._caches.pop(request.session_id, None)
            candidates = [(c, False) for c in (own,) if c is not None and c.weight_version == version]
            candidates += [(c, True) for c in self._shared.values() if c.weight_version == version]
        best, reuse, shared = None, 0, False
        for cached, from_store in candidates:  # the session's own cache first: it usually covers all but the new ids
            if reuse >= len(request.context) - 1 or len(cached.tokens) <= reuse:
                continue  # nothing longer to gain from this one
            common = _common_prefix(cached.tokens, request.context)
            if common > reuse:
                best, reuse, shared = cached, common, from_store
        if best is None:
            return None, 0, False
        if shared:
            with self._cond:
                self._shared.move_to_end(tuple(best.tokens), last=True)
        return best.kv, min(reuse, len(request.context) - 1), shared  # at least one id to prefill, for its logits

    def _step_admissions(self, admit: list[_SessionRequest]) -> None:
        """Prefill the admitted requests in groups of similar suffix length (padding costs compute)."""
        taken = []
        for request in admit:
            if request.cancelled:
                self._finish(request, None)
                continue
            request.weight_version = self.engine.weight_version
            kv, reuse, shared = self._take_cache(request)
            with self._cond:
                self._counters["shared_tokens" if shared else "reused_tokens"] += reuse
            request.shareable = shared or reuse == 0
            taken.append((len(request.context) - reuse, request, kv, reuse))
        taken.sort(key=lambda t: t[0])
        group: list = []
        for item in taken:
            if group and item[0] > 1.5 * group[0][0] + 16:
                self._prefill_group(group)
                group = []
            group.append(item)
        if group:
            self._prefill_group(group)

    def _prefill_group(self, group: list) -> None:
        try:
            self._prefill([(request, kv, reuse) for _, request, kv, reuse in group])
        except Exception as exc:  # noqa: BLE001 - these callers get the error, the running rows go on
            for _, request, _, _ in group:
                self._finish(request, None, error=exc)

    def _prefill(self, group: list) -> None:
        """One forward over the new ids of several requests, each after its reused cache.

        Layout of row ``i``: ``[padding | its c_i cached ids | padding | its s_i new ids]``, with
        the attention mask off on both paddings and position ids counting real ids only, so each
        row sees exactly its own context. The rows are then compacted to the running batch's
        layout (padding first) and sampled from; unfinished ones join the batch.
        """
        engine, dev = self.engine, self.engine.device
        requests = [request for request, _, _ in group]
        # identical requests (same context, same cache to extend) are computed once: the siblings
        # of a GRPO group open their sessions with the same prompt
        first_of: dict[tuple, int] = {}
        copy_of = [first_of.setdefault((id(kv) if reuse else None, reuse, tuple(request.context)), row)
                   for row, (request, kv, reuse) in enumerate(group)]
        distinct = sorted(set(copy_of))
        shareable = [row for row in distinct if group[row][0].shareable]
        original, group = group, [group[row] for row in distinct]
        reuses = [reuse for _, _, reuse in group]
        suffixes = [request.context[reuse:] for request, _, reuse in group]
        b, wc, ws = len(group), max(reuses), max(len(x) for x in suffixes)
        cache = new_kv_cache(engine.model.config)
        if wc:
            for index, layer in enumerate(cache.layers):
                keys, values = [], []
                for _, kv, reuse in group:
                    if reuse:
                        k, v = kv[index][0][:, :, :reuse], kv[index][1][:, :, :reuse]
                    else:  # a row with nothing cached next to rows with a cache: all padding
                        like = next(kv for _, kv, r in group if r)[index][0]
                        k = v = like.new_zeros((1, like.shape[1], 0, like.shape[3]))
                    keys.append(_pad_left(k, wc - reuse, 2))
                    values.append(_pad_left(v, wc - reuse, 2))
                layer.update(torch.cat(keys), torch.cat(values))
        input_ids = torch.full((b, ws), engine.pad_token_id, dtype=torch.long)
        attention = torch.zeros((b, wc + ws), dtype=torch.long)
        positions = torch.zeros((b, ws), dtype=torch.long)
        for row, (reuse, suffix) in enumerate(zip(reuses, suffixes)):
            input_ids[row, ws - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
            attention[row, wc - reuse : wc] = 1
            attention[row, wc + ws - len(suffix):] = 1
            positions[row, ws - len(suffix):] = torch.arange(reuse, reuse + len(suffix))
        attention = attention.to(dev)
        out = engine.model(input_ids=input_ids.to(dev), attention_mask=attention, position_ids=positions.to(dev),
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
        copies = len(requests) - b
        with self._cond:
            self._counters["prefill_forwards"] += 1
            self._counters["prefill_tokens"] += sum(len(x) for x in suffixes)
            self._counters["shared_tokens"] += sum(len(request.context) - reuse for row, (request, _, reuse)
                                                   in enumerate(original) if copy_of[row] != row)
        # compact: each row's real columns, in order, right-aligned to width n = longest context
        lengths = [len(r.context) for r, _, _ in group]
        n = max(lengths)
        source = torch.zeros((b, n), dtype=torch.long)
        for row, length in enumerate(lengths):
            source[row, n - length:] = attention[row].nonzero().squeeze(-1).cpu()
        source = source.to(dev)
        for layer in cache.layers:
            index = source[:, None, :, None].expand(b, layer.keys.shape[1], n, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        row_of = {original_row: row for row, original_row in enumerate(distinct)}  # request row -> computed row
        self._store_shared([(group[row_of[r]][0].context, row_of[r]) for r in shareable], cache, n)
        logits = out.logits[:, -1, :]
        if copies:  # give every request its row: the copies share their first's keys, values and logits
            expand = torch.tensor([row_of[first] for first in copy_of], dtype=torch.long, device=dev)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, expand), layer.values.index_select(0, expand)
            logits = logits.index_select(0, expand)
        b = len(requests)
        lengths = [len(r.context) for r in requests]
        mask = torch.zeros((b, n), dtype=torch.long, device=dev)
        for row, (request, length) in enumerate(zip(requests, lengths)):
            mask[row, n - length:] = 1
            request.cached = list(request.context)
        finished = self._sample(requests, logits)
        done = [row for row, f in enumerate(finished) if f]
        for row in done:
            self._finish(requests[row], [(layer.keys[row : row + 1, :, n - lengths[row]:].clone(),
                                          layer.values[row : row + 1, :, n - lengths[row]:].clone())
                                         for layer in cache.layers])
        keep = [row for row in range(b) if not finished[row]]
        if keep:
            if len(keep) < b:
                mask = _select_rows(cache, mask, keep)
            self._join([requests[row] for row in keep], cache, mask)

    def _store_shared(self, contexts: list, cache, width: int) -> None:
        """Keep the keys and values of contexts computed without a session's own cache (rows of
        the compacted ``cache``, right-aligned to ``width``) for other sessions that open with the
        same ids."""
        version = self.engine.weight_version
        for context, row in contexts:
            key = tuple(context)
            kv = [(layer.keys[row : row + 1, :, width - len(context):].clone(),
                   layer.values[row : row + 1, :, width - len(context):].clone()) for layer in cache.layers]
            with self._cond:
                self._shared[key] = _SessionCache(list(context), kv, version)
                self._shared.move_to_end(key, last=True)
                # bounded like the session caches: at most half their token budget, and 64 contexts
                total = sum(len(c.tokens) for c in self._shared.values())
                while len(self._shared) > _SHARED_CONTEXTS or (total > self.session_cache_tokens // 2 and len(self._shared) > 1):
                    _, dropped = self._shared.popitem(last=False)
                    total -= len(dropped.tokens)

    def _join(self, requests: list[_SessionRequest], cache, mask: torch.Tensor) -> None:
        """Append rows (``cache`` and ``mask`` left-padded among themselves) to the running batch;
        only the joining rows are copied (``GrowingLayer.append_rows``)."""
        if not self._rows:
            self._batch, self._attention = new_kv_cache(self.engine.model.config), mask.new_zeros((0, 0))
        old, new = self._attention.shape[1], mask.shape[1]
        width = max(old, new)
        rows = len(self._rows) + len(requests)
        room = min(self.max_running, max(rows + rows // 4, 8))  # spare rows for sessions coming back
        for layer, added in zip(self._batch.layers, cache.layers):
            layer.append_rows(added.keys, added.values, room)
        self._attention = torch.cat([_pad_left(self._attention, width - old, 1), _pad_left(mask, width - new, 1)], dim=0)
        self._rows.extend(requests)

    def _decode(self) -> None:
        cancelled = [row for row, r in enumerate(self._rows) if r.cancelled]
        if cancelled:
            self._remove_rows(cancelled, keep_caches=False)
            if not self._rows:
                return
        engine, dev = self.engine, self.engine.device
        tokens = torch.tensor([[r.pending] for r in self._rows], dtype=torch.long, device=dev)
        positions = torch.tensor([[len(r.cached)] for r in self._rows], dtype=torch.long, device=dev)
        self._attention = torch.cat([self._attention, self._attention.new_ones((len(self._rows), 1))], dim=1)
        out = engine.model(input_ids=tokens, attention_mask=self._attention, position_ids=positions,
                           past_key_values=self._batch, use_cache=True)
        for r in self._rows:
            r.cached.append(r.pending)
        with self._cond:
            self._counters["decode_steps"] += 1
        finished = self._sample(self._rows, out.logits[:, -1, :])
        done = [row for row, f in enumerate(finished) if f]
        if done:
            self._remove_rows(done, keep_caches=True)

    def _remove_rows(self, rows: list[int], keep_caches: bool) -> None:
        width = self._attention.shape[1]
        for row in rows:
            request = self._rows[row]
            kv = None
            if keep_caches:
                start = width - len(request.cached)  # the row's padding ends here
                kv = [(layer.keys[row : row + 1, :, start:].clone(), layer.values[row : row + 1, :, start:].clone())
                      for layer in self._batch.layers]
            self._finish(request, kv)
        gone = set(rows)
        kept = len(self._rows) - len(gone)
        if not kept:
            self._rows, self._batch, self._attention = [], None, None
            return
        # fill the holes below ``kept`` with the surviving rows above it: only those rows are copied
        holes = sorted(row for row in gone if row < kept)
        movers = [row for row in range(kept, len(self._rows)) if row not in gone]
        moves = list(zip(movers, holes))
        for src, dst in moves:
            self._rows[dst] = self._rows[src]
        del self._rows[kept:]
        mask = self._attention
        if moves:
            mask = mask.clone()
            mask[[dst for _, dst in moves]] = mask[[src for src, _ in moves]]
        mask = mask[:kept]
        lead = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())  # columns that are padding in every kept row
        for layer in self._batch.layers:
            layer.move_rows(moves, kept, lead)
        self._attention = mask[:, lead:]

    def _sample(self, requests: list[_SessionRequest], logits: torch.Tensor) -> list[bool]:
        """Sample one id per request from its row of ``logits``, record it, and say which finished."""
        engine = self.engine
        groups: dict[tuple, list[int]] = {}
        for row, r in enumerate(requests):
            groups.setdefault(r.sampling_key, []).append(row)
        tokens = [0] * len(requests)
        token_logprobs = [0.0] * len(requests)
        for rows in groups.values():
            sampling = requests[rows[0]].sampling
            sub = logits if len(groups) == 1 else logits[torch.tensor(rows, device=logits.device)]
            logp = process_logits(sub, sampling)
            if sampling.greedy:
                drawn = torch.argmax(logp, dim=-1)
            else:
                drawn = engine._draw(logp, [requests[row].generator for row in rows])
            reported = logp if sampling.logprobs_mode == "processed" else torch.log_softmax(sub.float(), dim=-1)
            picked = reported.gather(-1, drawn[:, None]).squeeze(-1).tolist()
            for row, tok, lp in zip(rows, drawn.tolist(), picked):
                tokens[row], token_logprobs[row] = tok, float(lp)
        finished = []
        for r, tok, lp in zip(requests, tokens, token_logprobs):
            r.ids.append(tok)
            r.logprobs.append(lp)
            r.pending = tok
            done = True
            if tok in engine.eos_token_ids:
                r.finish = "eos"
            elif r.stop_strings and (hit := engine._matched_stop(r.ids, r.stop_strings, r.window)) is not None:
                r.finish, r.stop_string = "stop", hit
            elif len(r.ids) >= r.max_new_tokens:
                r.finish = "length"
            else:
                done = False
            finished.append(done)
        return finished

    def _finish(self, request: _SessionRequest, kv, error: BaseException | None = None) -> None:
        """Settle the caller's future and keep the session's cache (``kv`` holds ``request.cached``)."""
        with self._cond:
            self._busy.discard(request.session_id)
            keep = (kv is not None and error is None and not request.cancelled and request.session_id in self._open
                    and request.weight_version == self.engine.weight_version)
            if keep:
                self._caches[request.session_id] = _SessionCache(list(request.cached), kv, request.weight_version)
                self._evict()
        if request.cancelled:
            return
        if error is not None:
            _deliver(request, error=error)
            return
        result = GenerationResult(
            token_ids=list(request.ids), logprobs=list(request.logprobs), finish_reason=request.finish,
            stop_string=request.stop_string, weight_version=request.weight_version,
            text=self.engine.tokenizer.decode(request.ids, skip_special_tokens=False),
        )
        _deliver(request, result)

    def _evict(self) -> None:  # called with self._cond held; least recently finished first
        total = sum(len(c.tokens) for c in self._caches.values())
        while self._caches and total > self.session_cache_tokens:
            _, dropped = self._caches.popitem(last=False)
            total -= len(dropped.tokens)


class HFEngine:
    """Token-in/token-out generation with a transformers causal LM (see the module docstring).

    ``model`` is a spec for ``raggym.models.load_policy`` (``"smollm2-135m"``, a local dir, a hub
    id) or an already-loaded ``PreTrainedModel``, in which case ``tokenizer`` is required.
    """

    kind = "hf"

    def __init__(
        self,
        model="smollm2-135m",
        tokenizer=None,
        *,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        eos_token_ids: Sequence[int] | None = None,
        weight_version: int = 0,
        num_threads: int | None = None,
        session_cache_tokens: int = 32768,
        max_running: int = 64,
    ):
        if num_threads:
            torch.set_num_threads(int(num_threads))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if isinstance(model, str):
            from raggym.models import load_policy

            model, tokenizer = load_policy(model, dtype=dtype, device=device)
        elif tokenizer is None:
            raise ValueError("HFEngine needs the tokenizer when it is given a loaded model")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos_token_ids = _eos_ids(model, tokenizer, eos_token_ids)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(self.eos_token_ids) if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        self.weight_version = int(weight_version)
        self._sync_group: WeightSyncGroup | None = None
        self._sessions = _SessionScheduler(self, session_cache_tokens=session_cache_tokens, max_running=max_running)

    # ------------------------------------------------------------------ generation

    def _generators(self, sampling: SamplingParams, n: int) -> list[torch.Generator] | None:
        if sampling.seed is None or sampling.greedy:
            return None
        gens = []
        for i in range(n):
            g = torch.Generator(device=self.device)
            g.manual_seed(derive_seed(sampling.seed, i))
            gens.append(g)
        return gens

    @staticmethod
    def _draw(logp: torch.Tensor, gens: Sequence[torch.Generator | None] | None) -> torch.Tensor:
        # Inverse-CDF sampling with one uniform number per row, drawn from that row's own
        # generator (torch's global one for a ``None`` entry): token = first v with
        # CDF(v) > u·CDF(V). Only tokens with p > 0 can be hit (the CDF is flat across zeros);
        # the fallback covers the u·total == total rounding edge.
        probs = logp.exp()
        cdf = probs.cumsum(-1)
        if gens is None:
            u = torch.rand(logp.shape[0], device=logp.device)
        else:
            u = torch.cat([torch.rand(1, generator=g, device=logp.device) for g in gens])
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=logp.shape[-1] - 1)
        hit_zero = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
        return torch.where(hit_zero, probs.argmax(-1), tokens)

    def _matched_stop(self, ids: list[int], stop_strings: Sequence[str], window: int) -> str | None:
        text = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
        for s in stop_strings:
            if s in text:
                return s
        return None

    @torch.inference_mode()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> list[GenerationResult]:
        """Sample one continuation per prompt; see ``actors.engines.base`` for the result's meaning."""
        with self._sessions.model_lock:
            return self._generate(prompt_token_ids, sampling, stop_strings, max_new_tokens)

    def _generate(self, prompt_token_ids, sampling, stop_strings, max_new_tokens) -> list[GenerationResult]:
        prompts = check_prompts(prompt_token_ids, max_new_tokens)
        if not prompts:
            return []
        sampling = sampling or SamplingParams()
        stop_strings = [s for s in stop_strings if s]
        window = max((len(s.encode("utf-8")) for s in stop_strings), default=0) + _STOP_WINDOW_MARGIN
        n, dev = len(prompts), self.device

        width = max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # count real tokens only

        cache = new_kv_cache(self.model.config)
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        next_position = positions[:, -1] + 1
        gens = self._generators(sampling, n)

        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        finish: list[str] = ["length"] * n
        matched: list[str | None] = [None] * n
        active = list(range(n))  # prompt index of each row still in the batch

        for _ in range(max_new_tokens):
            logp = process_logits(logits, sampling)
            if sampling.greedy:
                tokens = torch.argmax(logp, dim=-1)
            else:
                tokens = self._draw(logp, None if gens is None else [gens[i] for i in active])
            reported = logp if sampling.logprobs_mode == "processed" else torch.log_softmax(logits.float(), dim=-1)
            token_lp = reported.gather(-1, tokens[:, None]).squeeze(-1).tolist()
            tokens_list = tokens.tolist()

            keep_rows = []
            for row, i in enumerate(active):
                tok = tokens_list[row]
                ids[i].append(tok)
                lps[i].append(float(token_lp[row]))
                if tok in self.eos_token_ids:
                    finish[i] = "eos"
                elif stop_strings and (hit := self._matched_stop(ids[i], stop_strings, window)) is not None:
                    finish[i], matched[i] = "stop", hit
                elif len(ids[i]) >= max_new_tokens:
                    finish[i] = "length"
                else:
                    keep_rows.append(row)
            if not keep_rows:
                break
            if len(keep_rows) < len(active):
                keep = torch.tensor(keep_rows, dtype=torch.long, device=dev)
                cache.batch_select_indices(keep)
                attention, next_position, tokens = attention[keep], next_position[keep], tokens[keep]
                active = [active[r] for r in keep_rows]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=-1)
            out = self.model(
                input_ids=tokens[:, None], attention_mask=attention, position_ids=next_position[:, None],
                past_key_values=cache, use_cache=True,
            )
            logits = out.logits[:, -1, :]
            next_position = next_position + 1

        return [
            GenerationResult(
                token_ids=ids[i], logprobs=lps[i], finish_reason=finish[i], stop_string=matched[i],
                weight_version=self.weight_version,
                text=self.tokenizer.decode(ids[i], skip_special_tokens=False),
            )
            for i in range(n)
        ]

    # ------------------------------------------------------------------ sessions

    async def generate_async(
        self,
        session_id: str,
        context_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> GenerationResult:
        """Sample one continuation of a session's whole context (see ``SessionEngine``).

        The request's random stream is seeded with ``derive_seed(sampling.seed, 0)``, the stream
        of prompt 0 in ``generate``, so a session's first turn samples what ``generate`` of the
        same single prompt samples, whatever other sessions are batched with it.
        """
        return await self._sessions.submit(str(session_id), context_token_ids, sampling or SamplingParams(),
                                           stop_strings, max_new_tokens)

    def end_session(self, session_id: str) -> None:
        """Forget a session's KV cache (a request of it still in flight finishes normally)."""
        self._sessions.end(str(session_id))

    def load(self) -> dict:
        """``{"sessions": open sessions, "running": requests in flight}``, for least-loaded routing."""
        return self._sessions.load()

    def session_stats(self) -> dict:
        """Counters since the engine was built: ``prefill_tokens`` (computed), ``reused_tokens``
        (taken from session caches), ``prefill_forwards`` (admissions are prefilled together),
        ``decode_steps``, ``requests``, ``cached_tokens`` (held now)."""
        return self._sessions.stats()

    def close(self) -> None:
        """Stop the scheduler thread; requests still waiting fail with ``RuntimeError``."""
        self._sessions.close()

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors, version: int | None = None, *, strict: bool = True) -> int:
        """Copy new values into the model's parameters in place; returns the new weight version.

        ``named_tensors`` is ``FlatWeights``, a state-dict-like mapping or ``(name, tensor)`` pairs
        with the model's own parameter names (tied weights may come under either name). The
        version is ``version`` if given, else the one ``FlatWeights`` carries, else the old one + 1.
        With ``strict`` every parameter must be covered and every name must exist.

        Session requests in flight finish first, with the old weights (new ones wait), so every
        result has one weight version; then every session's KV cache is dropped, since it was
        computed with the old weights.
        """
        with self._sessions.paused_for_update():
            return self._update_weights(named_tensors, version, strict)

    def _update_weights(self, named_tensors, version: int | None, strict: bool) -> int:
        pairs, carried = named_tensors_of(named_tensors)
        targets = self.model.state_dict(keep_vars=True)
        loaded: set[int] = set()
        unknown: list[str] = []
        with torch.no_grad():
            for name, tensor in pairs:
                target = targets.get(name)
                if target is None:
                    unknown.append(name)
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
                target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
                loaded.add(id(target))
        if strict:
            missing = [n for n, p in self.model.named_parameters() if id(p) not in loaded]
            if unknown or missing:
                raise KeyError(f"weight update does not match the model: unknown={unknown[:5]} missing={missing[:5]}")
        self.weight_version = int(version if version is not None else carried if carried is not None else self.weight_version + 1)
        self._sessions.drop_caches()
        return self.weight_version

    def load_state_dict(self, state_dict, version: int | None = None) -> int:
        return self.update_weights(state_dict, version)

    # collective path: one rank per HF engine
    sync_ranks = 1

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str = "gloo") -> None:
        """Join a ``WeightSyncGroup`` as rank ``rank_offset`` (blocks until all ranks join)."""
        device = self.device if backend == "nccl" else "cpu"
        self._sync_group = WeightSyncGroup(host, port, rank_offset, world_size, backend=backend, device=device)

    def receive_weights(self) -> int:
        """Receive one broadcast from the group's rank 0 and load it; returns the new version."""
        if self._sync_group is None:
            raise RuntimeError("call init_weight_sync before receive_weights")
        with self._sessions.paused_for_update():
            version, tensors = self._sync_group.receive()
            return self._update_weights(tensors, version, strict=True)

    def info(self) -> dict:
        return {
            "kind": self.kind,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype),
            "weight_version": self.weight_version,
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }


__all__ = ["HFEngine", "process_logits"]
