"""Span labelling for the six dialects, token labels from offsets, and the loss mask."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raggym.algorithms import (
    DIALECT_TAGS,
    SpanLabel,
    find_segments,
    label_characters,
    label_text_tokens,
    label_tokens,
    loss_mask_from_labels,
    tag_sequence,
    teacher_kl_mask_from_labels,
    transcript_with_observation_spans,
)

P, T, Q, A, O, X = (SpanLabel.PROMPT, SpanLabel.THINK, SpanLabel.QUERY, SpanLabel.ANSWER,
                    SpanLabel.OBSERVATION, SpanLabel.OTHER)

PROMPT = "Question: who built it?\n"

# One hand-written trajectory per dialect, as (text piece, label of every character in it).
TRAJECTORIES = {
    "routerag": [
        (PROMPT, P),
        ("<think>I should look it up in the graph.</think>", T), ("\n", X),
        ("<search> [graph][passage] Eiffel Tower architect </search>", Q), ("\n\n", X),
        ("<information>Doc 1 (Title: Eiffel Tower) Designed by Gustave Eiffel.</information>", O),
        ("\n", X), ("<answer>Gustave Eiffel</answer>", A),
    ],
    "search_r1": [
        (PROMPT, P),
        ("<think>search</think>", T), ("<search>Eiffel Tower architect</search>", Q),
        ("<information>Doc 1 Gustave Eiffel</information>", O),
        ("<think>found</think>", T), ("<answer>Gustave Eiffel</answer>", A),
    ],
    "graph_r1": [
        (PROMPT, P),
        ("<think>query the graph</think>", T), (" ", X), ("<query>Eiffel Tower builder</query>", Q),
        ("<knowledge>(Eiffel Tower, designed by, Gustave Eiffel)</knowledge>", O),
        ("<answer>Gustave Eiffel</answer>", A),
    ],
    "lws": [
        (PROMPT, P),
        ("<think>I do not know</think>", T), ("<search>Eiffel Tower architect</search>", Q),
        ("<information>Doc 1 Gustave Eiffel</information>", O),
        ("<reflect>the document names him</reflect>", T), ("<answer>Gustave Eiffel</answer>", A),
    ],
    "graphrag_r1": [
        (PROMPT, P),
        ("<think>need facts</think>", T), ("<|begin_of_query|> Eiffel Tower architect <|end_of_query|>", Q),
        ("\n", X),
        ("<|begin_of_documents|>\n(Eiffel Tower designed_by Gustave Eiffel)\nDoc: ...\n<|end_of_documents|>", O),
        ("<think>done</think>", T), ("<answer>Gustave Eiffel</answer>", A),
    ],
    "r1_router": [
        ("Question: who built it?\nDocuments: [1] Gustave Eiffel designed the tower.\n", P),
        ("<think>the text KB should know</think>", T),
        ("<sub-question>Who designed the Eiffel Tower?</sub-question>", Q),
        ("<ret>text</ret>", Q), ("\n", X),
        ("<think>the document says Eiffel</think>", T), ("<answer>Gustave Eiffel</answer>", A),
    ],
}


def _build(pieces):
    text = "".join(p for p, _ in pieces)
    labels = np.concatenate([np.full(len(p), int(label), dtype=np.int64) for p, label in pieces])
    return text, labels


def _offsets_within_pieces(pieces, width=4):
    """Hand-built tokenisation: each piece is cut into tokens of ≤ width characters."""
    offsets, expected, pos = [], [], 0
    for piece, label in pieces:
        for start in range(0, len(piece), width):
            offsets.append((pos + start, pos + min(start + width, len(piece))))
            expected.append(int(label))
        pos += len(piece)
    return offsets, np.array(expected)


@pytest.mark.parametrize("dialect", sorted(TRAJECTORIES))
def test_character_and_token_labels_per_dialect(dialect):
    pieces = TRAJECTORIES[dialect]
    text, expected_chars = _build(pieces)
    chars = label_characters(text, dialect, prompt_chars=len(pieces[0][0]))
    np.testing.assert_array_equal(chars, expected_chars)

    offsets, expected_tokens = _offsets_within_pieces(pieces)
    tokens = label_text_tokens(text, offsets, dialect, prompt_chars=len(pieces[0][0]))
    np.testing.assert_array_equal(tokens, expected_tokens)

    mask = loss_mask_from_labels(tokens)
    # loss mask is 0 exactly on prompt and observation tokens
    np.testing.assert_array_equal(mask == 0, np.isin(expected_tokens, [int(P), int(O)]))
    kl_mask = teacher_kl_mask_from_labels(tokens)
    np.testing.assert_array_equal(kl_mask == 1, np.isin(expected_tokens, [int(T), int(Q)]))


def test_tag_sequences():
    text, _ = _build(TRAJECTORIES["lws"][1:])
    assert tag_sequence(text, "lws") == ["think", "search", "information", "reflect", "answer"]
    text, _ = _build(TRAJECTORIES["graphrag_r1"][1:])
    assert tag_sequence(text, "graphrag_r1") == ["think", "query", "documents", "think", "answer"]
    with pytest.raises(ValueError, match="unknown dialect"):
        tag_sequence("x", "nope")


def test_unclosed_think_stops_at_the_next_tag():
    text = "<think>no closing tag <information>retrieved</information><answer>x</answer>"
    segs = find_segments(text, "search_r1")
    assert [(s.name, s.closed) for s in segs] == [("think", False), ("information", True), ("answer", True)]
    assert segs[0].end == text.index("<information>")
    labels = label_characters(text, "search_r1")
    assert labels[text.index("retrieved")] == O


def test_unclosed_final_span_runs_to_the_end():
    text = "<think>a</think><answer>unfinished"
    labels = label_characters(text, "routerag")
    assert (labels[text.index("<answer>"):] == A).all()


def test_other_dialect_tags_are_plain_text():
    # <query>/<knowledge> are graph_r1 tags; under search_r1 they are just text inside think.
    text = "<think>maybe <query>x</query></think><knowledge>y</knowledge>"
    labels = label_characters(text, "search_r1")
    assert (labels[: text.index("<knowledge>")] == T).all()
    assert (labels[text.index("<knowledge>"):] == X).all()


def test_explicit_observation_spans_override_tags():
    inserted = "<information>env text</information>"
    fake = "<information>made up by the model</information>"
    text = "<think>a</think>" + inserted + fake + "<answer>b</answer>"
    start = text.index(inserted)
    labels = label_characters(text, "search_r1", observation_spans=[(start, start + len(inserted))])
    assert (labels[start:start + len(inserted)] == O).all()
    fake_start = text.index(fake)
    assert (labels[fake_start:fake_start + len(fake)] == X).all()  # model output: trained on
    # without explicit spans the tags are trusted and the fake observation is masked
    assert (label_characters(text, "search_r1")[fake_start:fake_start + len(fake)] == O).all()


def test_explicit_observation_cuts_an_unclosed_span():
    obs = "<information>doc</information>"
    text = "<think>unclosed " + obs + " more</think>"
    start = text.index(obs)
    labels = label_characters(text, "search_r1", observation_spans=[(start, start + len(obs))])
    assert (labels[:start] == T).all()
    assert (labels[start:start + len(obs)] == O).all()
    assert (labels[start + len(obs):] == X).all()  # the stray "</think>" is not a span


def test_straddling_and_empty_tokens():
    # chars: PPP TT OO XX  → labels by index
    chars = np.array([P, P, P, T, T, O, O, X, X], dtype=np.int64)
    offsets = [
        (0, 0),  # special token at the start → PROMPT
        (2, 4),  # prompt + think → PROMPT wins
        (4, 6),  # think + observation → OBSERVATION wins
        (3, 5),  # all think
        (5, 5),  # empty → inherits the previous token's label (THINK)
        (7, 9),  # other
        (4, 5), (6, 8),  # think; observation + other → OBSERVATION
        (8, 9),
        (9, 9),  # empty after OTHER → OTHER
    ]
    got = label_tokens(chars, offsets)
    assert got.tolist() == [P, P, O, T, T, X, T, O, X, X]


def test_majority_and_tie_rules():
    chars = np.array([T, X, X, Q, X], dtype=np.int64)
    # (0, 3): THINK 1, OTHER 2 → OTHER; (2, 4): OTHER 1, QUERY 1 → tie goes to QUERY (smaller value)
    assert label_tokens(chars, [(0, 3), (2, 4)]).tolist() == [X, Q]


def test_masks_accept_torch():
    labels = torch.tensor([[P, T, Q, A, O, X]])
    torch.testing.assert_close(loss_mask_from_labels(labels), torch.tensor([[0.0, 1, 1, 1, 0, 1]]))
    torch.testing.assert_close(teacher_kl_mask_from_labels(labels), torch.tensor([[0.0, 1, 1, 0, 0, 0]]))


# --- property: random well-formed trajectories are labelled exactly ----------------------------

_plain = st.text(alphabet="abc xyz.,()\n0123", min_size=0, max_size=12)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(DIALECT_TAGS)), st.data())
def test_property_random_segments_labelled(dialect, data):
    rules = DIALECT_TAGS[dialect]
    n = data.draw(st.integers(0, 6))
    pieces = [(data.draw(_plain), P)]
    for _ in range(n):
        gap = data.draw(_plain)
        if gap:
            pieces.append((gap, X))
        rule = data.draw(st.sampled_from(rules))
        pieces.append((rule.open + data.draw(_plain) + rule.close, rule.label))
    text, expected = _build(pieces)
    labels = label_characters(text, dialect, prompt_chars=len(pieces[0][0]))
    np.testing.assert_array_equal(labels, expected)
    mask = loss_mask_from_labels(labels)
    np.testing.assert_array_equal(mask == 0, np.isin(expected, [int(P), int(O)]))


def test_transcript_with_observation_spans_masks_environment_newlines():
    prompt = "Q?\n"
    turns = [
        ("<think>a</think><search>x</search>", "\n\n<information>doc</information>\n\n"),
        ("<answer>b</answer>", ""),
    ]
    text, prompt_chars, spans = transcript_with_observation_spans(prompt, turns)
    assert text == prompt + turns[0][0] + turns[0][1] + turns[1][0]
    assert prompt_chars == 3
    start = 3 + len(turns[0][0])
    assert spans == [(start, start + len(turns[0][1]))]
    labels = label_characters(text, "search_r1", prompt_chars, spans)
    # the environment's newlines around <information> are masked too; tags alone would leave
    # them as OTHER
    assert (labels[start:start + len(turns[0][1])] == O).all()
    assert label_characters(text, "search_r1", prompt_chars)[start] == X
    assert (labels[text.index("<answer>"):] == A).all()
