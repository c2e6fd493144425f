"""The scripted engine: turns, seeded alternatives, cutting like a sampler, call log, registry."""

import json

import pytest

from actors.engines import SamplingParams, make_engine
from actors.engines.scripted import ScriptedEngine
from raggym.protocol import get_dialect
from raggym.trajectory import chat_prompt_ids

STOPS = list(get_dialect("routerag").stop_strings)


@pytest.fixture(scope="module")
def engine():
    return make_engine("scripted", model="smollm2-135m")  # built through the engine registry


def _prompt(engine, question="Who directed Inception?"):
    return chat_prompt_ids(engine.tokenizer, get_dialect("routerag").instruction_prompt(question))


def test_each_turn_plays_the_next_entry_and_parses_as_the_dialect_expects(engine):
    dialect = get_dialect("routerag")
    ids = _prompt(engine)
    kinds = []
    for turn in range(4):
        (result,) = engine.generate([ids], None, STOPS, 128)
        action = dialect.parse(result.text)
        kinds.append((action.kind, action.mode, action.query))
        assert result.finish_reason == "stop" and result.text.endswith(result.stop_string)
        assert result.logprobs == [0.0] * len(result.token_ids)
        observation = dialect.render_observation([], ()) if action.kind == "search" else ""
        ids = ids + result.token_ids + engine.tokenizer(observation, add_special_tokens=False)["input_ids"]
    question = "Who directed Inception?"
    assert kinds == [("search", "passage", question), ("search", "graph", question), ("answer", None, None),
                     ("answer", None, None)]  # past the end, the last entry repeats


def test_alternatives_follow_the_prompts_seed_and_cuts_match_a_sampler(engine):
    scripted = ScriptedEngine(tokenizer=engine.tokenizer, script=[[f"<search> [passage] q{i} </search> tail" for i in range(4)]])
    prompts = [_prompt(engine, f"question {i}") for i in range(6)]
    first = [r.text for r in scripted.generate(prompts, SamplingParams(seed=3), STOPS, 64)]
    assert first == [r.text for r in scripted.generate(prompts, SamplingParams(seed=3), STOPS, 64)]
    assert len(set(first)) > 1  # the prompts' own streams pick different alternatives
    assert all(t.endswith("</search>") for t in first)  # cut at the stop string; " tail" never emitted
    assert {r.text for r in scripted.generate(prompts, None, STOPS, 64)} == {"<search> [passage] q0 </search>"}
    (short,) = scripted.generate(prompts[:1], None, STOPS, 3)
    assert short.finish_reason == "length" and len(short.token_ids) == 3 and short.stop_string is None
    (no_stop,) = scripted.generate(prompts[:1], None, [], 64)
    assert no_stop.finish_reason == "eos" and no_stop.token_ids[-1] == engine.tokenizer.eos_token_id


def test_call_log_weight_updates_and_bad_scripts(engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    scripted = ScriptedEngine(tokenizer=engine.tokenizer, delay_s=0.2, call_log=log)
    scripted.generate([_prompt(engine)] * 2, None, STOPS, 64)
    start, end = [json.loads(line) for line in log.read_text().splitlines()]
    assert (start["event"], end["event"], start["call"], end["call"], start["turns"]) == ("start", "end", 0, 0, [0, 0])
    # the log's wall-clock stamps may run a little slow against the monotonic clock the delay uses
    assert end["time"] - start["time"] >= 0.2 - 0.01
    assert scripted.update_weights({}, 7) == 7 and scripted.update_weights({}) == 8
    with pytest.raises(RuntimeError, match="object-store weight sync"):
        scripted.init_weight_sync("127.0.0.1", 1, 0, 2)
    with pytest.raises(ValueError, match="script entry 1 must be a non-empty string"):
        ScriptedEngine(tokenizer=engine.tokenizer, script=["<answer> a </answer>", []])
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        ScriptedEngine(tokenizer=engine.tokenizer, delay_s=-1)
