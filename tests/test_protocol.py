"""Hand-written cases for every dialect, modelled on the examples each paper describes."""

from __future__ import annotations

import pytest

from raggym.protocol import (
    ACTION_KINDS,
    DIALECT_NAMES,
    DIALECTS,
    PAPER_KNOWLEDGE_BASES,
    Dialect,
    R1RouterDialect,
    get_dialect,
    scan_tags,
)
from raggym.retrieval.base import Hit

HITS = [
    Hit("p1", "Curious (fragrance)", "Curious is a women's fragrance by Britney Spears.", 0.9),
    Hit("p2", "Britney Spears", "Britney Spears was born in McComb, Mississippi.", 0.8),
]
FACTS = [("Curious", "created by", "Britney Spears", 0.9), ("Britney Spears", "born in", "McComb", 0.7)]


# ----------------------------------------------------------------------------- registry


def test_registry_has_the_six_dialects():
    assert DIALECT_NAMES == ("routerag", "search_r1", "graph_r1", "lws", "graphrag_r1", "r1_router")
    for name in DIALECT_NAMES:
        dialect = get_dialect(name)
        assert isinstance(dialect, Dialect) and dialect.name == name
    assert get_dialect(DIALECTS["lws"]) is DIALECTS["lws"]


def test_unknown_dialect_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dialect 'routerag2'.*routerag"):
        get_dialect("routerag2")


@pytest.mark.parametrize(
    "name, stops",
    [
        ("routerag", ("</search>", "</answer>")),
        ("search_r1", ("</search>", "</answer>")),
        ("graph_r1", ("</query>", "</answer>")),
        ("lws", ("</search>", "</answer>")),
        ("graphrag_r1", ("<|end_of_query|>", "</answer>")),
        ("r1_router", ("</ret>", "</answer>")),
    ],
)
def test_stop_strings_end_each_action(name, stops):
    assert get_dialect(name).stop_strings == stops


@pytest.mark.parametrize("name", DIALECT_NAMES)
def test_parse_rejects_non_strings(name):
    with pytest.raises(TypeError, match="expects the segment as str"):
        get_dialect(name).parse(b"<answer>x</answer>")


# ----------------------------------------------------------------------------- RouteRAG

ROUTERAG = get_dialect("routerag")


@pytest.mark.parametrize(
    "search, mode, query",
    [
        ("<search> [passage] Curious fragrance </search>", "passage", "Curious fragrance"),
        ("<search> [graph] who created the fragrance Curious </search>", "graph", "who created the fragrance Curious"),
        ("<search> [graph][passage] Britney Spears birthplace </search>", "hybrid", "Britney Spears birthplace"),
        ("<search> [passage][graph] Britney Spears birthplace </search>", "hybrid", "Britney Spears birthplace"),
        ("<search>[graph] [passage]Britney Spears birthplace</search>", "hybrid", "Britney Spears birthplace"),
        # A bracket group that is not a mode identifier belongs to the query.
        ("<search> [passage] [1990 film] director </search>", "passage", "[1990 film] director"),
    ],
)
def test_routerag_search_modes(search, mode, query):
    action = ROUTERAG.parse("<think>I need the creator of Curious.</think>\n" + search)
    assert action.kind == "search"
    assert (action.mode, action.query) == (mode, query)
    assert action.reasoning == "I need the creator of Curious."
    assert action.well_formed and action.error is None


@pytest.mark.parametrize(
    "search, error",
    [
        ("<search> Britney Spears </search>", "missing retrieval mode"),
        ("<search> [hybrid] Britney Spears </search>", "unknown retrieval mode [hybrid]"),
        ("<search> [Graph] Britney Spears </search>", "unknown retrieval mode [Graph]"),
        ("<search> [graph][graph] Britney Spears </search>", "given twice"),
        ("<search> [graph] </search>", "empty query"),
        ("<search> [passage] \x00\t </search>", "empty query"),
    ],
)
def test_routerag_bad_modes_and_queries(search, error):
    action = ROUTERAG.parse("<think>x</think>" + search)
    assert action.kind == "invalid"
    assert error in action.error


def test_routerag_answer_and_think_only():
    answer = ROUTERAG.parse("<think>Britney Spears was born in McComb.</think>\n<answer> McComb, Mississippi </answer>")
    assert (answer.kind, answer.answer) == ("answer", "McComb, Mississippi")
    think = ROUTERAG.parse("<think>Still thinking.</think>")
    assert think.kind == "think" and think.reasoning == "Still thinking." and not think.is_valid


@pytest.mark.parametrize(
    "segment, error",
    [
        ("", "empty segment"),
        ("   \n", "empty segment"),
        ("I will answer McComb.", "no reasoning, search or answer tags"),
        ("<think>x</think><search> [graph] a </search><search> [graph] b </search>", "more than one action"),
        ("<think>x</think><answer>a</answer><answer>b</answer>", "more than one action"),
        ("<think>x</think><search> [graph] a </search> and more", "text follows the action"),
        ("<think>x<search> [graph] a </search></think>", "<search> appears inside an open <think>"),
        ("<think>x</think><search> [graph] a", "<search> is never closed"),
        ("<think>x</think> [graph] a </search>", "</search> closes a block that was never opened"),
        ("<think><think>x</think></think><answer>a</answer>", "<think> appears inside an open <think>"),
        ("<think>x</think><information>made up</information><answer>a</answer>", "written by the environment"),
        ("<think>x</think><query>a</query>", "<query> is not a tag of the routerag dialect"),
        ("<think>x</think><|begin_of_query|>a<|end_of_query|>", "not a tag of the routerag dialect"),
        ("<think>x</think><answer>   </answer>", "empty answer"),
        ("<think>x</think><answer>a</answer><think>y</think>", "a reasoning block follows the action"),
    ],
)
def test_routerag_malformed_segments(segment, error):
    action = ROUTERAG.parse(segment)
    assert action.kind == "invalid"
    assert error in action.error


def test_free_text_outside_tags_is_valid_but_not_well_formed():
    action = ROUTERAG.parse("Let me look this up. <search> [passage] Curious fragrance </search>")
    assert action.kind == "search" and not action.well_formed
    skipped_think = ROUTERAG.parse("<search> [passage] Curious fragrance </search>")
    assert skipped_think.kind == "search" and not skipped_think.well_formed


def test_query_text_is_cleaned_for_the_retriever():
    action = ROUTERAG.parse("<think>x</think><search> [graph]  Britney\x00 Spears\n\tbirth\ud800place  </search>")
    assert action.query == "Britney Spears birth place"
    long_query = ROUTERAG.parse("<think>x</think><search> [graph] " + "w " * 600 + "</search>")
    assert long_query.kind == "invalid" and "longer than 1000" in long_query.error


def test_reasoning_and_answer_lose_lone_surrogates():
    action = ROUTERAG.parse("<think>a\ud800b</think><answer>x\udfffy</answer>")
    assert action.reasoning == "a\ufffdb" and action.answer == "x\ufffdy"
    action.answer.encode("utf-8")  # storable


def test_routerag_observation_and_error_forms():
    observation = ROUTERAG.render_observation(HITS)
    assert observation == (
        "\n\n<information>"
        "Doc 1 (Title: Curious (fragrance)) Curious is a women's fragrance by Britney Spears.\n"
        "Doc 2 (Title: Britney Spears) Britney Spears was born in McComb, Mississippi.\n"
        "</information>\n\n"
    )
    assert "No documents were found" in ROUTERAG.render_observation([])
    error = ROUTERAG.render_error("missing retrieval mode")
    assert error.startswith("\n\n<information>Invalid action: missing retrieval mode.")
    assert error.endswith("</information>\n\n") and "[graph][passage]" in error


def test_observation_cap_cuts_the_body_not_the_tags():
    capped = ROUTERAG.render_observation(HITS * 50, max_chars=200)
    assert len(capped) == 200
    assert capped.startswith("\n\n<information>") and capped.endswith("</information>\n\n")
    with pytest.raises(ValueError, match="cannot hold"):
        ROUTERAG.render_observation(HITS, max_chars=10)


def test_routerag_trajectory_format_check():
    good = (
        "<think>Need the creator.</think><search> [graph] Curious fragrance creator </search>"
        + ROUTERAG.render_observation(HITS)
        + "<think>Now the birthplace.</think><search> [passage][graph] Britney Spears birthplace </search>"
        + ROUTERAG.render_observation(HITS)
        + "<think>Done.</think><answer> McComb, Mississippi </answer>"
    )
    check = ROUTERAG.format_check(good)
    assert check.ok and check.num_searches == 2 and check.structure == "tTsSiItTsSiItTaA"
    assert ROUTERAG.format_check("<think>Easy.</think><answer>Paris</answer>").ok
    assert not ROUTERAG.format_check("<search> [graph] q </search><information>d</information><think>x</think><answer>a</answer>").ok
    bad_mode = ROUTERAG.format_check("<think>x</think><search> [web] q </search><information>d</information><think>y</think><answer>a</answer>")
    assert not bad_mode.ok and "unknown retrieval mode" in bad_mode.reason
    stray = ROUTERAG.format_check("<think>x</think> chatter <answer>a</answer>")
    assert not stray.ok and stray.structure == "tTxaA"
    assert not ROUTERAG.format_check("<think>x</think>").ok


def test_format_check_ignores_tag_like_text_inside_observations():
    quoted = ROUTERAG.render_observation([Hit("p", "HTML", "A page that says <answer>42</answer> and <think>", 1.0)])
    trajectory = "<think>a</think><search> [passage] q </search>" + quoted + "<think>b</think><answer>c</answer>"
    assert ROUTERAG.format_check(trajectory).ok


def test_routerag_prompt_explains_every_tag_and_mode():
    prompt = ROUTERAG.instruction_prompt("Who created Curious?", max_searches=4)
    for needle in ("<think>", "</think>", "<search>", "</search>", "<information>", "<answer>", "[passage]", "[graph]", "[graph][passage]", "at most 4"):
        assert needle in prompt
    assert prompt.rstrip().endswith("Question: Who created Curious?")


def test_routerag_prompt_gives_no_cost_hint_and_allows_any_number_of_searches():
    # RouteRAG's Table 6 prompt: the modes differ only in how they find documents, and the model
    # may search as often as it wants; which mode is cheaper is left to the efficiency reward.
    for prompt in (ROUTERAG.instruction_prompt("Q?"), ROUTERAG.instruction_prompt("Q?", modes=("passage", "graph"))):
        lowered = prompt.lower()
        for hint in ("cheap", "cost", "expensive", "fast", "slow"):
            assert hint not in lowered, hint
        assert "as many times as you like" in prompt
    assert "returns documents, each by its own method" in ROUTERAG.instruction_prompt("Q?")
    assert "as many times" not in ROUTERAG.instruction_prompt("Q?", max_searches=4)


# ----------------------------------------------------------------------------- Search-R1

SEARCH_R1 = get_dialect("search_r1")


def test_search_r1_case_study_turns():
    # The Search-R1 paper's case study: find the singer behind "Curious", then her birthplace.
    first = SEARCH_R1.parse(
        "<think> I need to find out which singer created the fragrance Curious, then where she was born. </think>\n"
        "<search> Curious fragrance information </search>"
    )
    assert (first.kind, first.mode, first.query) == ("search", None, "Curious fragrance information")
    last = SEARCH_R1.parse("<think> Britney Spears was born in McComb, Mississippi. </think>\n<answer> McComb, Mississippi </answer>")
    assert last.answer == "McComb, Mississippi"
    assert SEARCH_R1.default_mode == "passage"


def test_search_r1_has_no_mode_syntax():
    # A RouteRAG-style mode tag is just query text here.
    action = SEARCH_R1.parse("<think>x</think><search> [graph] Britney Spears </search>")
    assert action.query == "[graph] Britney Spears" and action.mode is None


def test_search_r1_format_check_and_prompt():
    trajectory = (
        "<think>a</think><search>Curious fragrance</search>" + SEARCH_R1.render_observation(HITS)
        + "<think>b</think><answer>McComb, Mississippi</answer>"
    )
    assert SEARCH_R1.format_check(trajectory).ok
    assert not SEARCH_R1.format_check("<think>a</think><query>q</query><knowledge>k</knowledge><think>b</think><answer>c</answer>").ok
    prompt = SEARCH_R1.instruction_prompt("Q?")
    assert "<search>" in prompt and "<information>" in prompt and "[graph]" not in prompt


# ----------------------------------------------------------------------------- Graph-R1 / PathRouter

GRAPH_R1 = get_dialect("graph_r1")


@pytest.mark.parametrize(
    "query_block, query",
    [
        ("<query> Curious fragrance creator </query>", "Curious fragrance creator"),
        ('<query>\n{"query": "Curious fragrance creator"}\n</query>', "Curious fragrance creator"),
        ("<query> {braces} in a plain query </query>", "{braces} in a plain query"),
    ],
)
def test_graph_r1_query_forms(query_block, query):
    action = GRAPH_R1.parse("<think>Which singer made Curious?</think>" + query_block)
    assert (action.kind, action.query) == ("search", query)
    assert GRAPH_R1.default_mode == "graph"


def test_graph_r1_rejects_search_tags_and_bad_json():
    assert GRAPH_R1.parse("<think>x</think><search>q</search>").kind == "invalid"
    bad = GRAPH_R1.parse('<think>x</think><query>{"query": 7}</query>')
    assert bad.kind == "invalid" and '"query" field' in bad.error
    assert GRAPH_R1.parse('<think>x</think><query>{"query": "  "}</query>').error == "empty query"


def test_graph_r1_knowledge_observation_and_format():
    observation = GRAPH_R1.render_observation(HITS)
    assert observation.startswith("\n\n<knowledge>Doc 1 (Title: Curious (fragrance))") and observation.endswith("</knowledge>\n\n")
    assert GRAPH_R1.render_error("empty query").startswith("\n\n<knowledge>Invalid action: empty query.")
    trajectory = "<think>a</think><query>q</query>" + observation + "<think>b</think><answer>McComb</answer>"
    assert GRAPH_R1.format_check(trajectory).ok
    assert GRAPH_R1.parse("<think>x</think><knowledge>k</knowledge><answer>a</answer>").error.endswith("not the model")
    prompt = GRAPH_R1.instruction_prompt("Q?")
    assert all(tag in prompt for tag in ("<think>", "<query>", "<knowledge>", "<answer>"))


# ----------------------------------------------------------------------------- LWS

LWS = get_dialect("lws")


def test_lws_segments_per_turn():
    first = LWS.parse("<think>I should check who made Curious.</think><search>Curious fragrance creator</search>")
    assert first.kind == "search" and first.well_formed
    later = LWS.parse("<reflect>The creator is Britney Spears; I still need her birthplace.</reflect><search>Britney Spears birthplace</search>")
    assert later.kind == "search" and later.reasoning.startswith("The creator")
    direct = LWS.parse("<think>Paris is the capital of France.</think><reflect>I am sure.</reflect><answer>Paris</answer>")
    assert direct.kind == "answer" and direct.reasoning == "Paris is the capital of France.\nI am sure."


@pytest.mark.parametrize(
    "trajectory, ok",
    [
        # think -> reflect -> answer
        ("<think>a</think><reflect>b</reflect><answer>Paris</answer>", True),
        # think -> (search -> information -> reflect)+ -> answer
        ("<think>a</think><search>q</search><information>d</information><reflect>b</reflect><answer>x</answer>", True),
        ("<think>a</think><search>q1</search><information>d</information><reflect>b</reflect>"
         "<search>q2</search><information>d</information><reflect>c</reflect><answer>x</answer>", True),
        ("\n<think>a</think>\n<search>q</search>\n\n<information>d</information>\n\n<reflect>b</reflect>\n<answer>x</answer>\n", True),
        # missing reflect after information
        ("<think>a</think><search>q</search><information>d</information><answer>x</answer>", False),
        # no think first
        ("<reflect>b</reflect><answer>x</answer>", False),
        # answer without reflect
        ("<think>a</think><answer>x</answer>", False),
        # two thinks
        ("<think>a</think><think>a</think><reflect>b</reflect><answer>x</answer>", False),
        # search without information
        ("<think>a</think><search>q</search><reflect>b</reflect><answer>x</answer>", False),
        # empty answer / empty query
        ("<think>a</think><reflect>b</reflect><answer> </answer>", False),
        ("<think>a</think><search> </search><information>d</information><reflect>b</reflect><answer>x</answer>", False),
        # nested tags
        ("<think>a<reflect>b</reflect></think><answer>x</answer>", False),
        # unclosed
        ("<think>a</think><reflect>b<answer>x</answer>", False),
        # text outside tags
        ("<think>a</think>so<reflect>b</reflect><answer>x</answer>", False),
    ],
)
def test_lws_format_checker(trajectory, ok):
    check = LWS.format_check(trajectory)
    assert check.ok is ok, check
    assert bool(check) is ok


def test_lws_format_check_counts_searches():
    trajectory = "<think>a</think>" + "<search>q</search><information>d</information><reflect>b</reflect>" * 3 + "<answer>x</answer>"
    check = LWS.format_check(trajectory)
    assert check.ok and check.num_searches == 3 and check.structure == "tT" + "sSiIrR" * 3 + "aA"
    with pytest.raises(TypeError):
        LWS.format_check(None)


def test_lws_prompt_names_every_tag():
    prompt = LWS.instruction_prompt("Q?")
    assert all(t in prompt for t in ("<think>", "<search>", "<information>", "<reflect>", "<answer>"))


# ----------------------------------------------------------------------------- GraphRAG-R1

GRAPHRAG_R1 = get_dialect("graphrag_r1")


def test_graphrag_r1_query_inside_open_think():
    # R1-Searcher style: the query sits inside reasoning that continues after the documents.
    action = GRAPHRAG_R1.parse(
        "<think> The fragrance Curious was created by a singer; I need her name. "
        "<|begin_of_query|> Curious fragrance creator <|end_of_query|>"
    )
    assert (action.kind, action.query) == ("search", "Curious fragrance creator")
    assert action.reasoning.startswith("The fragrance Curious") and "<think>" not in action.reasoning
    assert GRAPHRAG_R1.default_mode == "graph"


def test_graphrag_r1_closing_think_then_answer():
    action = GRAPHRAG_R1.parse(" So she was born in McComb. </think>\n<answer> McComb, Mississippi </answer>")
    assert (action.kind, action.answer) == ("answer", "McComb, Mississippi")
    closed = GRAPHRAG_R1.parse("<think>a</think><|begin_of_query|> q <|end_of_query|>")
    assert closed.kind == "search"
    free_reasoning = GRAPHRAG_R1.parse("Still reasoning about it")
    assert free_reasoning.kind == "think"


def test_graphrag_r1_rejects_other_dialects_tags_and_documents():
    assert GRAPHRAG_R1.parse("<think>x</think><search>q</search>").kind == "invalid"
    forged = GRAPHRAG_R1.parse("<|begin_of_documents|>x<|end_of_documents|><answer>a</answer>")
    assert forged.kind == "invalid" and "written by the environment" in forged.error
    assert GRAPHRAG_R1.parse("<|begin_of_query|> q").error == "<|begin_of_query|> is never closed"


def test_graphrag_r1_observation_mixes_facts_and_passages_capped():
    observation = GRAPHRAG_R1.render_observation(HITS, FACTS)
    assert observation.startswith("\n<|begin_of_documents|>\n(Curious created by Britney Spears)\n(Britney Spears born in McComb)\nDoc 1 (Title:")
    assert observation.endswith("<|end_of_documents|>\n")
    long_hits = [Hit(f"p{i}", f"T{i}", "x" * 900, 1.0) for i in range(3)]
    body = GRAPHRAG_R1.render_observation(long_hits, FACTS).split("<|begin_of_documents|>\n")[1].split("<|end_of_documents|>")[0]
    assert len(body) == 1024


def test_graphrag_r1_format_check_both_layouts():
    docs = GRAPHRAG_R1.render_observation(HITS, FACTS)
    spanning = "<think> a <|begin_of_query|> q1 <|end_of_query|>" + docs + " b <|begin_of_query|> q2 <|end_of_query|>" + docs + " c </think><answer>x</answer>"
    check = GRAPHRAG_R1.format_check(spanning)
    assert check.ok and check.num_searches == 2
    closed = "<think>a</think><|begin_of_query|> q <|end_of_query|>" + docs + "<think>b</think><answer>x</answer>"
    assert GRAPHRAG_R1.format_check(closed).ok
    assert GRAPHRAG_R1.format_check("<think>a</think><answer>x</answer>").ok
    assert not GRAPHRAG_R1.format_check("<think>a<answer>x</answer></think>").ok
    assert not GRAPHRAG_R1.format_check("<think>a <|begin_of_query|> q <|end_of_query|></think><answer>x</answer>").ok


def test_graphrag_r1_prompt_uses_the_markers():
    prompt = GRAPHRAG_R1.instruction_prompt("Q?")
    assert all(t in prompt for t in ("<|begin_of_query|>", "<|end_of_query|>", "<|begin_of_documents|>", "<|end_of_documents|>", "<answer>"))


# ----------------------------------------------------------------------------- R1-Router

R1_ROUTER = get_dialect("r1_router")


def test_r1_router_routing_steps_from_the_paper_examples():
    # HotpotQA-style example: which magazine started first?
    step = R1_ROUTER.parse(
        "<think>We want to compare when the two magazines started; first find when Arthur's Magazine began.</think>\n"
        "<sub-question>When did the magazine 'Arthur's Magazine' start?</sub-question>\n<ret>Text Retriever</ret>"
    )
    assert (step.kind, step.mode, step.query) == ("route", "Text Retriever", "When did the magazine 'Arthur's Magazine' start?")
    visual = R1_ROUTER.parse("<think>Identify the person first.</think><sub-question>Who is this person in the image?</sub-question><ret>Text Image Retriever</ret>")
    assert visual.mode == "Text Image Retriever"
    table = R1_ROUTER.parse("<think>Election results live in tables.</think><sub-question>Which party won 51.0% in Brooklyn?</sub-question><ret> table  retriever </ret>")
    assert table.mode == "Table Retriever"  # case and spacing are normalised to the configured name


def test_r1_router_none_none_stops():
    stop = R1_ROUTER.parse("<think>Both start dates are known.</think>\n<sub-question>None</sub-question>\n<ret>None</ret>")
    assert stop.kind == "route" and stop.query is None and stop.mode is None and stop.stops_routing
    assert R1_ROUTER.parse("<think>a</think><sub-question> none </sub-question><ret>NONE</ret>").stops_routing
    # the paper's condition is the sub-question alone: a None sub-question stops whatever <ret> says
    any_kb = R1_ROUTER.parse("<think>a</think><sub-question>None</sub-question><ret>Text Retriever</ret>")
    assert any_kb.stops_routing and any_kb.mode is None and any_kb.well_formed


@pytest.mark.parametrize(
    "segment, error",
    [
        ("<think>a</think><sub-question>When?</sub-question><ret>None</ret>", "needs a None sub-question"),
        ("<think>a</think><sub-question>When?</sub-question><ret>Web Search</ret>", "unknown knowledge base"),
        ("<think>a</think><sub-question>When?</sub-question>", "must be followed by <ret>"),
        ("<think>a</think><ret>Text Retriever</ret>", "<ret> must follow a <sub-question>"),
        ("<think>a</think><sub-question> </sub-question><ret>Text Retriever</ret>", "empty sub-question"),
        ("<think>a</think><sub-question>q</sub-question><ret>Text Retriever</ret><answer>x</answer>", "more than one action"),
        ("<think>a</think><answer>x</answer><answer>y</answer>", "more than one action"),
        ("<think>a</think><search>q</search>", "not a tag of the r1_router dialect"),
    ],
)
def test_r1_router_malformed(segment, error):
    action = R1_ROUTER.parse(segment)
    assert action.kind == "invalid" and error in action.error


def test_r1_router_answer_step_and_custom_knowledge_bases():
    answer = R1_ROUTER.parse("<think>The documents say 1844.</think>\n<answer>1844</answer>")
    assert (answer.kind, answer.answer) == ("answer", "1844")
    custom = R1RouterDialect(["text", "table"])
    assert custom.parse("<think>a</think><sub-question>q</sub-question><ret>Table</ret>").mode == "table"
    assert custom.parse("<think>a</think><sub-question>q</sub-question><ret>Text Retriever</ret>").kind == "invalid"
    with pytest.raises(ValueError, match="collide"):
        R1RouterDialect(["Text", "text"])
    with pytest.raises(ValueError):
        R1RouterDialect([])
    with pytest.raises(ValueError):
        R1RouterDialect(["None"])


def test_r1_router_prompts_and_format():
    routing = R1_ROUTER.routing_prompt("Which magazine started first?", [("When did Arthur's Magazine start?", "1844")])
    assert "<sub-question>" in routing and "<ret>" in routing and "None" in routing
    assert all(kb in routing for kb in PAPER_KNOWLEDGE_BASES)
    assert routing.endswith("Original question: Which magazine started first?\nSub-question 1: When did Arthur's Magazine start?\nAnswer 1: 1844\n")
    assert R1_ROUTER.instruction_prompt("Q?") == R1_ROUTER.routing_prompt("Q?")
    docs = R1_ROUTER.render_observation(HITS)
    assert docs.startswith("Doc 1 (Title: Curious (fragrance))") and "<" not in docs.split(")")[0]
    sub = R1_ROUTER.intermediate_answer_prompt("Who made Curious?", docs)
    assert "Documents:\nDoc 1" in sub and sub.endswith("Question: Who made Curious?\n") and "<answer>" in sub
    final = R1_ROUTER.final_answer_prompt("Q?", [("a?", "b")])
    assert "Sub-question 1: a?\nAnswer 1: b" in final
    assert R1_ROUTER.format_check("<think>a</think><sub-question>q</sub-question><ret>Text Retriever</ret>").ok
    assert R1_ROUTER.format_check("<think>a</think><answer>x</answer>").ok
    assert not R1_ROUTER.format_check("<sub-question>q</sub-question><ret>Text Retriever</ret>").ok
    assert not R1_ROUTER.format_check("<think>a</think><sub-question> </sub-question><ret>Text Retriever</ret>").ok
    assert R1_ROUTER.render_error("bad").startswith("Your previous output was invalid: bad.")


# ----------------------------------------------------------------------------- shared machinery


def test_scan_tags_reports_literals_blocks_and_offsets():
    tags = scan_tags("a<think>b</think><|begin_of_query|>")
    assert [(t.literal, t.block, t.opening, t.start) for t in tags] == [
        ("<think>", "think", True, 1),
        ("</think>", "think", False, 9),
        ("<|begin_of_query|>", "begin_of_query", True, 17),
    ]


@pytest.mark.parametrize("name", DIALECT_NAMES)
def test_megabyte_and_hostile_segments_parse_without_raising(name):
    dialect = get_dialect(name)
    for segment in (
        "<think>" * 200_000,
        "x" * 1_000_000,
        "\ud800\udfff\x00\x1b" * 1000 + "<answer>a</answer>",
        "".join(chr(c) for c in range(0, 0x3000)),
    ):
        assert dialect.parse(segment).kind in ACTION_KINDS
        assert isinstance(dialect.format_check(segment).ok, bool)


def test_actions_serialise():
    action = ROUTERAG.parse("<think>x</think><search> [graph] q </search>")
    assert action.as_dict() == {
        "kind": "search", "mode": "graph", "query": "q", "answer": None, "reasoning": "x", "error": None, "well_formed": True,
    }
