"""``ScriptedEngine``: an engine that plays a fixed script of assistant segments.

It implements the engine interface of ``actors.engines.base`` (token ids in, token ids out) but
samples nothing: for each prompt it renders the script's next segment and returns its token ids.
It is a policy with known behaviour, for testing environments, rewards and the rollout runtime
(grouping of searches, retries after a killed actor) without a model that happens to search.

Registered as ``"scripted"``: ``make_engine("scripted", ...)``, ``RolloutWorker(engine="scripted")``
and ``rollout.engine: scripted`` in a training config all build it.

How a segment is chosen
  The *turn* of a prompt is the number of segments the model has already written in the current
  assistant message, counted as the occurrences of the call's stop strings after the chat
  template's assistant header (a tokenizer without a chat template: in the whole prompt). Turn
  ``t`` plays ``script[t]``; past the end, the last entry repeats. An entry is a template string
  or a list of alternative templates. With alternatives and a seeded ``SamplingParams``, prompt
  ``i`` of a call takes alternative ``derive_seed(seed, i) % len(alternatives)``, so a seeded
  rerun repeats every choice; without a seed it takes the first.

Template fields
  ``{question}`` is the first group of ``question_pattern`` matched in the prompt (by default the
  ``Question: ...`` line every search dialect's prompt ends with), ``{turn}`` the turn number.

What comes back
  The segment's ids (``tokenizer(text, add_special_tokens=False)``), cut like a sampling engine
  cuts: at the token that completes the first stop string (``finish_reason="stop"``), or at
  ``max_new_tokens`` (``"length"``); a segment that reaches neither ends with the tokenizer's EOS
  id (``"eos"``). Every logprob is 0.0: the script emits each token with probability one. It is
  not a distribution a learner can train on, and weight updates only advance ``weight_version``.

Sessions
  ``generate_async(session_id, context, ...)`` (the ``SessionEngine`` interface of the async
  rollout loop) plays the same script for one context: it returns ``generate([context], ...)[0]``,
  and concurrent requests overlap like a continuously batching engine's. ``end_session`` forgets
  the id; ``load()`` counts open sessions and requests in flight.

Delay and call log
  ``delay_s`` makes every ``generate`` call (and every ``generate_async`` request) take at least
  that long, like a model would, so a test can act while a call is in flight. With ``call_log`` (a file path) each call appends one
  JSON line when it starts (with the turn of each prompt) and one when it returns, both with the
  process id and a per-process call number: a call whose ``start`` has no ``end`` never returned
  (its process died mid-call).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Sequence

from actors.engines.base import GenerationResult, SamplingParams, check_prompts, derive_seed

# Search with the question in passage mode, then in graph mode, then give an answer: a run of the
# routerag dialect that exercises both retrieval modes. Other dialects need their own script.
DEFAULT_SCRIPT = (
    "<think>I look the question up.</think>\n<search> [passage] {question} </search>",
    "<think>I follow the entities.</think>\n<search> [graph] {question} </search>",
    "<think>That is enough.</think>\n<answer> unknown </answer>",
)
DEFAULT_QUESTION_PATTERN = r"Question: (.*)"


def _assistant_header(tokenizer) -> str | None:
    """The text a chat template puts between a user message and the assistant's reply."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u2063raggym-scripted-marker\u2063"  # text no real prompt contains
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                             tokenize=False)
    return rendered.split(marker, 1)[1] or None


class ScriptedEngine:
    """Plays ``script`` (see the module docstring); ``model`` names the tokenizer to use."""

    kind = "scripted"
    sync_ranks = 0  # no collective weight receiver: the trainer's object-store sync suffices

    def __init__(self, model: str = "smollm2-135m", tokenizer=None, *, script: Sequence = DEFAULT_SCRIPT,
                 delay_s: float = 0.0, call_log: str | os.PathLike | None = None,
                 question_pattern: str = DEFAULT_QUESTION_PATTERN, weight_version: int = 0,
                 device: str | None = None, dtype=None, num_threads: int | None = None):
        # device, dtype and num_threads are the model engines' options, which a training config
        # passes to every engine; a script has no use for them.
        if not script:
            raise ValueError("the script needs at least one segment")
        self.script = [self._check_entry(i, entry) for i, entry in enumerate(script)]
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        if tokenizer is None:
            from raggym.models import load_policy_tokenizer

            tokenizer = load_policy_tokenizer(model)
        self.tokenizer = tokenizer
        self.delay_s = float(delay_s)
        self.call_log = Path(call_log) if call_log else None
        self.question_pattern = re.compile(question_pattern)
        self.weight_version = int(weight_version)
        self.header = _assistant_header(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self._calls = itertools.count()
        self._sessions: set[str] = set()  # open sessions (the script keeps no state for them)
        self._running = 0

    @staticmethod
    def _check_entry(index: int, entry) -> tuple[str, ...]:
        alternatives = (entry,) if isinstance(entry, str) else tuple(entry)
        if not alternatives or not all(isinstance(a, str) and a for a in alternatives):
            raise ValueError(f"script entry {index} must be a non-empty string or a list of them, got {entry!r}")
        return alternatives

    # ------------------------------------------------------------------ generation

    def _log(self, event: str, call: int, **fields) -> None:
        if self.call_log is None:
            return
        line = json.dumps({"event": event, "pid": os.getpid(), "call": call, "time": time.time(), **fields}) + "\n"
        with open(self.call_log, "a", encoding="utf-8") as fh:  # one short O_APPEND write per line
            fh.write(line)

    def turn_of(self, prompt_text: str, stop_strings: Sequence[str]) -> int:
        """How many segments the assistant has already written in the prompt's current reply."""
        continuation = prompt_text.split(self.header, 1)[1] if self.header and self.header in prompt_text else prompt_text
        return sum(continuation.count(s) for s in stop_strings if s)

    def segment(self, prompt_text: str, turn: int, choice_seed: int | None) -> str:
        """The script's text for a prompt at ``turn`` (before tokenization and cutting)."""
        alternatives = self.script[min(turn, len(self.script) - 1)]
        chosen = alternatives[0] if choice_seed is None else alternatives[choice_seed % len(alternatives)]
        match = self.question_pattern.search(prompt_text)
        return chosen.format(question=match.group(1).strip() if match else "", turn=turn)

    def _result(self, text: str, stop_strings: Sequence[str], max_new_tokens: int) -> GenerationResult:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        finish, matched = "eos", None
        for end in range(1, len(ids) + 1):  # the first token whose prefix holds a stop string ends it
            prefix = self.tokenizer.decode(ids[:end], skip_special_tokens=False)
            hit = next((s for s in stop_strings if s and s in prefix), None)
            if hit is not None:
                ids, finish, matched = ids[:end], "stop", hit
                break
        if finish == "eos" and self.eos_token_id is not None:
            ids.append(int(self.eos_token_id))
        if len(ids) > max_new_tokens:
            ids, finish, matched = ids[:max_new_tokens], "length", None
        return GenerationResult(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish, stop_string=matched,
                                weight_version=self.weight_version,
                                text=self.tokenizer.decode(ids, skip_special_tokens=False))

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams | None = None,
                 stop_strings: Sequence[str] = (), max_new_tokens: int = 256) -> list[GenerationResult]:
        started = time.monotonic()
        prompts = check_prompts(prompt_token_ids, max_new_tokens)
        seed = None if sampling is None else sampling.seed
        texts = [self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        turns = [self.turn_of(t, stop_strings) for t in texts]
        call = next(self._calls)
        self._log("start", call, turns=turns)
        results = [self._result(self.segment(text, turn, None if seed is None else derive_seed(seed, i)),
                                stop_strings, max_new_tokens)
                   for i, (text, turn) in enumerate(zip(texts, turns))]
        time.sleep(max(0.0, self.delay_s - (time.monotonic() - started)))
        self._log("end", call)
        return results

    # ------------------------------------------------------------------ sessions (SessionEngine)

    async def generate_async(self, session_id: str, context_token_ids: Sequence[int],
                             sampling: SamplingParams | None = None, stop_strings: Sequence[str] = (),
                             max_new_tokens: int = 256) -> GenerationResult:
        """One session's next segment; the same as ``generate([context], sampling, ...)[0]``.

        Concurrent requests overlap: each takes ``delay_s`` on its own, as requests batched in a
        continuously batching engine do, and each is one call in the call log.
        """
        import asyncio

        started = time.monotonic()
        (prompt,) = check_prompts([context_token_ids], max_new_tokens)
        self._sessions.add(session_id)
        self._running += 1
        try:
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            turn = self.turn_of(text, stop_strings)
            call = next(self._calls)
            self._log("start", call, turns=[turn], session=session_id)
            seed = None if sampling is None or sampling.seed is None else derive_seed(sampling.seed, 0)
            result = self._result(self.segment(text, turn, seed), stop_strings, max_new_tokens)
            await asyncio.sleep(max(0.0, self.delay_s - (time.monotonic() - started)))
            self._log("end", call, session=session_id)
            return result
        finally:
            self._running -= 1

    def end_session(self, session_id: str) -> None:
        self._sessions.discard(session_id)

    def load(self) -> dict:
        return {"sessions": len(self._sessions), "running": self._running}

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors, version: int | None = None) -> int:
        """Accept a weight update (there are no weights); returns the new version."""
        from actors.weight_sync import named_tensors_of

        _, carried = named_tensors_of(named_tensors)
        self.weight_version = int(version if version is not None else carried if carried is not None
                                  else self.weight_version + 1)
        return self.weight_version

    def init_weight_sync(self, *args, **kwargs) -> None:
        raise RuntimeError("the scripted engine has no weights to receive over a collective; "
                           "use the object-store weight sync")

    def receive_weights(self) -> int:
        raise RuntimeError("the scripted engine has no weights to receive over a collective")

    def info(self) -> dict:
        return {"kind": self.kind, "pid": os.getpid(), "weight_version": self.weight_version,
                "script_entries": len(self.script), "delay_s": self.delay_s}


__all__ = ["DEFAULT_SCRIPT", "ScriptedEngine"]
