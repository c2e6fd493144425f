"""Answer-correctness judges: an LLM judge with a cache, and the lexical fallback (EM / F1 ≥ 0.5).

LWS decides whether an answer is "correct" with an LLM judge, during training (its answer reward
hinges on it) and at test time. raggym offers the same: a judge is any callable::

    judge(question, prediction, gold_answers) -> bool

``LLMJudge`` asks a language model. It is built on a text-in/text-out ``generate`` function, so
this layer stays free of engines and Ray; ``experiments.recipe.judge.make_judge`` builds one from an
engine spec (any registered engine and any model, the policy's own base model included). Its
verdicts are cached per (question, prediction, gold answers) — the gold answers belong to the
question, so in practice one entry per (question, answer) pair — and a repeated pair costs no
generation. A prediction of ``None`` (no answer) is wrong without asking.

``LexicalJudge`` is the documented fallback and the default when no judge is configured:
correct when the exact match (SQuAD normalisation) is 1 or the token F1 reaches 0.5. The LLM
judge uses it too for a reply it cannot read (neither "yes" nor "no"); ``unreadable`` counts those.

The prompt is ours; it asks for a one-word verdict so a handful of new tokens is enough.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from raggym.text_metrics import exact_match, token_f1

CORRECTNESS_RULES = ("em", "f1", "em_or_f1")

JUDGE_PROMPT = (
    "You grade answers to questions. Decide whether the predicted answer means the same thing as "
    "one of the reference answers: a different wording, an alias, an abbreviation or extra detail "
    "that does not contradict the reference is fine; a different entity, number or date is not, "
    "and neither is a hedge between several candidates.\n\n"
    "Question: {question}\n"
    "Reference answers: {golds}\n"
    "Predicted answer: {prediction}\n\n"
    "Reply with one word, yes or no."
)
_VERDICT = re.compile(r"[a-z]+")


class Judge(Protocol):
    def __call__(self, question: str, prediction: str | None, gold_answers: Sequence[str]) -> bool: ...


def lexical_correct(prediction: str | None, gold_answers: Sequence[str], rule: str = "em_or_f1",
                    f1_threshold: float = 0.5) -> bool:
    """The fallback rule: ``em`` (EM = 1), ``f1`` (F1 ≥ threshold) or ``em_or_f1`` (either)."""
    if rule not in CORRECTNESS_RULES:
        raise ValueError(f"correctness rule must be one of {', '.join(CORRECTNESS_RULES)}, got {rule!r}")
    if prediction is None:
        return False
    em_ok = exact_match(prediction, gold_answers) == 1.0
    if rule == "em":
        return em_ok
    f1_ok = token_f1(prediction, gold_answers) >= f1_threshold
    return f1_ok if rule == "f1" else em_ok or f1_ok


@dataclass(frozen=True)
class LexicalJudge:
    """EM / F1 ≥ ``f1_threshold`` as a judge (the question is not needed)."""

    rule: str = "em_or_f1"
    f1_threshold: float = 0.5

    def __post_init__(self):
        lexical_correct("", ("x",), self.rule)  # validates the rule name

    def __call__(self, question: str, prediction: str | None, gold_answers: Sequence[str]) -> bool:
        return lexical_correct(prediction, gold_answers, self.rule, self.f1_threshold)


def judge_prompt(question: str, prediction: str, gold_answers: Sequence[str]) -> str:
    golds = "; ".join(g.strip() for g in gold_answers if g and g.strip()) or "(none)"
    return JUDGE_PROMPT.format(question=question.strip(), golds=golds, prediction=prediction.strip())


def parse_verdict(reply: str) -> bool | None:
    """True for a reply whose first word is "yes", False for "no", None for anything else."""
    match = _VERDICT.search(reply.lower())
    if match is None:
        return None
    return {"yes": True, "no": False}.get(match.group(0))


class LLMJudge:
    """A language model as the judge, with a verdict cache (see the module docstring).

    ``generate(prompts) -> replies`` maps a list of prompt texts to the model's replies, one each,
    deterministically (greedy decoding), so a cached verdict is the verdict the model would give.
    """

    def __init__(self, generate: Callable[[list[str]], list[str]], *, fallback: Judge | None = None,
                 prompt: Callable[[str, str, Sequence[str]], str] = judge_prompt):
        self.generate = generate
        self.fallback = fallback if fallback is not None else LexicalJudge()
        self.prompt = prompt
        self._cache: dict[tuple, bool] = {}
        self.hits = self.misses = self.unreadable = 0

    @staticmethod
    def _key(question: str, prediction: str, gold_answers: Sequence[str]) -> tuple:
        return question, prediction.strip(), tuple(gold_answers)

    def judge_many(self, items: Sequence[tuple[str, str | None, Sequence[str]]]) -> list[bool]:
        """Verdicts for ``(question, prediction, gold_answers)`` items; one generate call for
        every pair not yet in the cache (each distinct pair once)."""
        todo: dict[tuple, tuple[str, str, Sequence[str]]] = {}
        for question, prediction, golds in items:
            if prediction is None:
                continue
            key = self._key(question, prediction, golds)
            if key in self._cache or key in todo:
                self.hits += 1
            else:
                self.misses += 1
                todo[key] = (question, prediction, golds)
        if todo:
            replies = self.generate([self.prompt(q, p, g) for q, p, g in todo.values()])
            if len(replies) != len(todo):
                raise RuntimeError(f"the judge model returned {len(replies)} replies for {len(todo)} prompts")
            for (key, (q, p, g)), reply in zip(todo.items(), replies):
                verdict = parse_verdict(reply)
                if verdict is None:
                    self.unreadable += 1
                    verdict = bool(self.fallback(q, p, g))
                self._cache[key] = verdict
        return [False if p is None else self._cache[self._key(q, p, g)] for q, p, g in items]

    def __call__(self, question: str, prediction: str | None, gold_answers: Sequence[str]) -> bool:
        return self.judge_many([(question, prediction, gold_answers)])[0]

    def cache_info(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._cache), "unreadable": self.unreadable}


def judge_many(judge: Judge, items: Sequence[tuple[str, str | None, Sequence[str]]]) -> list[bool]:
    """Batched verdicts from any judge: its own ``judge_many`` when it has one, else one call each."""
    batched = getattr(judge, "judge_many", None)
    if batched is not None:
        return [bool(v) for v in batched(items)]
    return [bool(judge(q, p, g)) for q, p, g in items]


@dataclass(frozen=True)
class JudgeConfig:
    """How ``experiments.recipe.judge.make_judge`` builds an LLM judge (the ``judge:`` config section).

    ``engine`` is any engine name ``actors.engines.make_engine`` knows (``hf``, ``vllm``, a
    registered name or ``"module:callable"``); ``model`` is any model spec, or ``"policy"`` for
    the policy's own base model (``policy.model``). Decoding is greedy.
    """

    engine: str = "hf"
    model: str = "policy"
    max_new_tokens: int = 4
    device: str | None = None  # passed to the engine when set (the HF engine: cpu / cuda)


__all__ = ["CORRECTNESS_RULES", "JUDGE_PROMPT", "Judge", "JudgeConfig", "LLMJudge", "LexicalJudge", "judge_many",
           "judge_prompt", "lexical_correct", "parse_verdict"]
