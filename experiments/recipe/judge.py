"""Build the LLM judge of answer correctness from a config section, on any generation engine.

    reward: {method: lws, stage2_start: 100, judge: {engine: vllm, model: policy}}
    raggym eval ... --judge-model policy [--judge-engine hf]

``model: policy`` is the policy's own base model (``policy.model``); any model spec works. The
engine is built in the calling process (the training driver, or the evaluation harness) through
``actors.engines.make_engine``, so ``engine`` is ``hf``, ``vllm``, a registered engine name or a
``"module:callable"`` import string. The judge decodes greedily and its verdicts are cached
(``raggym.judge.LLMJudge``); without a ``judge`` section, correctness falls back to
EM / F1 ≥ 0.5.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raggym.judge import JudgeConfig, LLMJudge

POLICY_MODEL = "policy"


def judge_config(spec: Mapping[str, Any] | JudgeConfig) -> JudgeConfig:
    """A ``JudgeConfig`` from a mapping, naming any unknown key."""
    if isinstance(spec, JudgeConfig):
        return spec
    known = {f.name for f in dataclasses.fields(JudgeConfig)}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"judge: unknown key(s) {unknown}; known: {sorted(known)}")
    return JudgeConfig(**dict(spec))


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as one user turn of the tokenizer's chat template (plain text
    when the tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in prompts]
        return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return [list(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in prompts]


def engine_judge(engine, config: JudgeConfig = JudgeConfig()) -> LLMJudge:
    """An ``LLMJudge`` on a built engine (anything with ``generate`` and ``tokenizer``)."""
    from actors.engines.base import SamplingParams

    greedy = SamplingParams(temperature=0.0)

    def generate(prompts: list[str]) -> list[str]:
        results = engine.generate(encode_prompts(engine.tokenizer, prompts), greedy, ("\n",), config.max_new_tokens)
        return [r.text for r in results]

    return LLMJudge(generate)


def make_judge(spec: Mapping[str, Any] | JudgeConfig | None, policy_model: str) -> LLMJudge | None:
    """The LLM judge a config asks for, or None (then correctness is EM / F1 ≥ 0.5)."""
    if spec is None:
        return None
    config = judge_config(spec)
    from actors.engines import make_engine

    model = policy_model if config.model == POLICY_MODEL else config.model
    kwargs = {"device": config.device} if config.device else {}
    return engine_judge(make_engine(config.engine, model=model, **kwargs), config)


__all__ = ["POLICY_MODEL", "encode_prompts", "engine_judge", "judge_config", "make_judge"]
