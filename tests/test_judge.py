"""Answer-correctness judges: the lexical fallback, the LLM judge's verdicts and its cache."""

import pytest

from raggym.judge import LexicalJudge, LLMJudge, judge_many, judge_prompt, lexical_correct, parse_verdict


def test_lexical_fallback_rules():
    # "Paris France" vs "Paris": EM 0, F1 2/3
    assert lexical_correct("Paris France", ["Paris"]) and lexical_correct("Paris France", ["Paris"], "f1")
    assert not lexical_correct("Paris France", ["Paris"], "em")
    assert not lexical_correct("Paris France", ["Paris"], "f1", f1_threshold=0.7)
    assert not lexical_correct(None, ["Paris"])
    assert LexicalJudge()("any question", "paris", ["Paris"])
    with pytest.raises(ValueError, match="correctness rule"):
        LexicalJudge(rule="bleu")


@pytest.mark.parametrize("reply, verdict", [("Yes", True), (" no.", False), ("YES, it matches", True),
                                            ("maybe", None), ("", None), ("123", None)])
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) is verdict


def test_prompt_holds_question_golds_and_prediction():
    text = judge_prompt("Who wrote Hamlet?", " the Bard ", ["William Shakespeare", "Shakespeare"])
    assert "Question: Who wrote Hamlet?" in text and "Predicted answer: the Bard\n" in text
    assert "Reference answers: William Shakespeare; Shakespeare" in text


def _replying(replies: dict):
    """A generate function answering from a table: it exercises the judge's batching, cache and
    fallback exactly; the real engine is tested below."""
    calls = []

    def generate(prompts):
        calls.append(list(prompts))
        return [replies[p.split("Predicted answer: ")[1].split("\n")[0]] for p in prompts]

    return generate, calls


def test_llm_judge_caches_each_pair_and_falls_back_on_unreadable_replies():
    generate, calls = _replying({"the Bard": "yes", "Lyon": "no", "Paris France": "perhaps"})
    judge = LLMJudge(generate)
    items = [("Who wrote Hamlet?", "the Bard", ["Shakespeare"]), ("Capital?", "Lyon", ["Paris"]),
             ("Capital?", "Paris France", ["Paris"]), ("Who wrote Hamlet?", "the Bard", ["Shakespeare"]),
             ("Capital?", None, ["Paris"])]
    # the unreadable reply uses EM / F1 ≥ 0.5: F1 2/3 → True; no answer is wrong without asking
    assert judge.judge_many(items) == [True, False, True, True, False]
    assert len(calls) == 1 and len(calls[0]) == 3  # three distinct pairs, one batched call
    assert judge("Who wrote Hamlet?", " the Bard", ["Shakespeare"]) is True  # cached (whitespace-insensitive)
    assert len(calls) == 1
    assert judge.cache_info() == {"hits": 2, "misses": 3, "size": 3, "unreadable": 1}
    # a plain function is a judge too
    assert judge_many(lambda q, p, g: p == "x", [("q", "x", ["y"]), ("q", "z", ["y"])]) == [True, False]


@pytest.fixture(scope="module")
def smollm_engine():
    from actors.engines import HFEngine

    return HFEngine("smollm2-135m", num_threads=1)


def test_judge_on_the_embedded_policy_engine_is_deterministic_and_cached(smollm_engine):
    from experiments.recipe.judge import engine_judge, make_judge

    judge = engine_judge(smollm_engine)
    calls = []
    real_generate = judge.generate
    judge.generate = lambda prompts: calls.append(len(prompts)) or real_generate(prompts)
    items = [("What is the capital of France?", "Paris", ["Paris"]),
             ("What is the capital of France?", "Berlin", ["Paris"])]
    first = judge.judge_many(items)
    assert all(isinstance(v, bool) for v in first) and calls == [2]
    assert judge.judge_many(items) == first and calls == [2]  # a repeated pair costs nothing
    assert judge.cache_info()["hits"] == 2
    # greedy decoding: a fresh judge on the same engine reaches the same verdicts
    assert engine_judge(smollm_engine).judge_many(items) == first
    # the config route: no section means no LLM judge; an unknown key is named
    assert make_judge(None, "smollm2-135m") is None
    with pytest.raises(ValueError, match="unknown key"):
        make_judge({"engine": "hf", "temperature": 0.5}, "smollm2-135m")
