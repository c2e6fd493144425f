"""Supervised cold start: fine-tune the policy on golden trajectories, loss on model tokens only.

Golden episodes are *played*, not written: for each question the real environment
(``RagSearchEnv``, or ``MultiKBRouteEnv`` for R1-Router) is reset with the question and the real
retriever, each step of ``Question.golden_trajectory`` is written as a model segment in the
dialect's own syntax (a short reasoning line plus the search, via ``Dialect.search_segment`` /
``answer_segment`` / ``R1RouterDialect.route_segment``), the environment is stepped so that the
observations are what retrieval actually returns, and the episode ends with the gold answer.
The tokens follow the rollout rules of ``raggym.trajectory.RolloutBuilder``: the prompt through
the chat template, model turns as their own tokens (loss mask 1), observations tokenized once and
capped (loss mask 0). A model trained on these sees exactly the token layout it will produce and
read during RL rollouts.

The trainer is a plain in-process torch loop: AdamW, token-mean masked cross-entropy over each
optimizer step (all micro-batches of a gradient-accumulation step share one denominator), fp32
on CPU and bf16 autocast on a GPU, optional LoRA (peft) merged into the weights before export.

Python API (used by the demo and the GraphRAG-R1 recipe)::

    examples = golden_examples(questions, retriever, "routerag", tokenizer)
    summary = run_sft("smollm2-135m", examples, "runs/sft", epochs=2, lr=1e-4)
    model, tok = raggym.models.load_policy(summary["policy_dir"])

Command line (builds the synthetic world, the index and the golden examples itself)::

    python -m experiments.recipe.sft --policy smollm2-135m --dialect routerag --synthetic-seed 0 \\
        --entities 300 --out runs/sft [--epochs 2 --lr 1e-4 --eval-questions 40] [--json]

Outputs under ``out_dir``: ``policy/`` (HF directory, safetensors weights and the tokenizer,
written to a temporary sibling and renamed into place), ``sft_metrics.jsonl`` (one line per
optimizer step) and ``sft_summary.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Sequence

from tqdm.auto import tqdm

from envs import MultiKBRouteEnv, RagSearchEnv, step_batch
from experiments.eval.harness import evaluate_episodes
from raggym.atomic import atomic_directory, atomic_write_json
from raggym.data.golden import with_golden_trajectories
from raggym.data.synthetic import generate_world
from raggym.models import apply_lora, load_policy, load_policy_tokenizer, lora_settings
from raggym.process_memory import release_freed_memory
from raggym.protocol import DIALECTS, get_dialect  # DIALECTS: the six built-ins plus register_dialect's
from raggym.retrieval import Retriever

# torch, and the modules that import it (raggym.trajectory, envs.rollout, actors.engines,
# actors.runtime), are imported in the functions that use them: `raggym` imports this module when
# it starts (the demo's arguments), and torch would add about 1.5 s to every command, --help too.

# Knowledge-base labels of the synthetic world's golden trajectories -> R1-Router base names.
DEFAULT_KB_NAMES = {"text": "Text Retriever", "table": "Table Retriever"}


# ============================================================================ golden episodes


def _check_dialect(dialect: str) -> str:
    if not isinstance(dialect, str) or dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
    return dialect


def make_env(dialect: str, retriever, *, top_k: int = 3, corpus=None, env_kwargs: dict | None = None,
             longest_trajectory: int = 4):
    """The environment a dialect runs in, with enough budget for ``longest_trajectory`` steps."""
    _check_dialect(dialect)
    kwargs = dict(env_kwargs or {})
    if dialect == "r1_router":
        kbs = kwargs.pop("knowledge_bases", None) or {DEFAULT_KB_NAMES["text"]: retriever}
        kwargs.setdefault("gold_knowledge_base_names", {k: v for k, v in DEFAULT_KB_NAMES.items() if v in kbs})
        kwargs.setdefault("max_route_steps", max(3, longest_trajectory))
        return MultiKBRouteEnv(kbs, None, top_k=top_k, corpus=corpus, **kwargs)

    kwargs.setdefault("retrieval_budget", max(4, longest_trajectory))
    return RagSearchEnv(retriever, None, dialect, top_k=top_k, corpus=corpus, **kwargs)


def _step_reasoning(question, steps: Sequence[dict], i: int) -> str:
    query = steps[i]["query"]
    if steps[i].get("retry"):  # says nothing of the first search's result: the retry is drawn blind
        return f"Let me look up {query} once more."
    if i == 0:
        cue = steps[i].get("cue")  # with_kind_cues: a sentence naming the question's type, never its mode
        return f"{cue} To answer this I first need {query}." if cue else f"To answer this I first need {query}."
    previous = steps[i - 1].get("answer")
    if previous is None:  # steps derived from gold passages name no intermediate answer
        return f"That helps. Next I need {query}."
    if question.kind == "comparison":
        return f"That gives {previous} for the first one. Now I need {query}."
    return f"The search says it is {previous}. Next I need {query}."


def _answer_reasoning(question, steps: Sequence[dict]) -> str:
    answer = question.answer
    if question.kind == "comparison" and len(steps) >= 2:
        values = " and ".join(str(s.get("answer")) for s in steps)
        return f"The years are {values}, so the answer is {answer}."
    if steps and steps[-1].get("answer") is not None:
        return f"The search says it is {steps[-1].get('answer')}, which answers the question."
    if steps:
        return f"The documents give the answer: {answer}."
    return f"I know this: {answer}."


def with_search_modes(questions, modes: str | Sequence[str] = "golden", seed: int = 0,
                      rotation: int | None = None) -> list:
    """Questions whose golden steps use the retrieval ``modes`` asked for (see ``golden_examples``).

    A random draw depends only on (seed, question id, step), so a question's modes do not change
    with the order or the company it is given in. With ``rotation`` r, step i takes
    ``modes[(r + i) % len(modes)]`` instead of a draw: the ``len(modes)`` rotations of a question
    give every step each listed mode once."""
    if modes == "golden":
        return list(questions)
    choices = (modes,) if isinstance(modes, str) else tuple(modes)
    if not choices:
        raise ValueError("modes: give 'golden', a mode name or a non-empty list of modes")
    out = []
    for q in questions:
        steps = []
        for i, step in enumerate(q.golden_trajectory):
            if rotation is None:
                mode = random.Random(f"{seed}/{q.id}/{i}").choice(choices)
            else:
                mode = choices[(int(rotation) + i) % len(choices)]
            steps.append({**step, "mode": mode})
        out.append(dataclasses.replace(q, golden_trajectory=tuple(steps)))
    return out


def parse_kind_cues(text: str) -> dict[str, str]:
    """``"graph_only=It asks about a person.;direct=It asks about a thing."`` -> ``{kind: sentence}``;
    ``""`` -> ``{}`` (no cues)."""
    cues = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, sep, sentence = item.partition("=")
        if not sep or not kind.strip() or not sentence.strip():
            raise ValueError(f"kind cue {item!r}: write kind=sentence, cues separated by ';'")
        cues[kind.strip()] = sentence.strip()
    return cues


def with_kind_cues(questions, cues: Mapping[str, str]) -> list:
    """Questions whose first golden thought opens with the sentence ``cues`` gives their ``kind``.

    The cue names what the question is about, so that SFT teaches the policy to say which type a
    question is before its first search; which mode that type needs is still RL's to learn (the
    search modes come from ``with_search_modes`` as before). A cue must not name a mode: that
    would teach the route itself. Questions of a kind without a cue are left as they are."""
    for kind, sentence in cues.items():
        named = [m for m in ("graph", "passage", "hybrid") if m in sentence.lower()]
        if named:
            raise ValueError(f"the cue for {kind!r} names the mode(s) {named}: a cue says what a question is "
                             "about, not how to search for it")
    out = []
    for q in questions:
        cue = cues.get(q.kind or "")
        if cue and q.golden_trajectory:
            first, *rest = q.golden_trajectory
            q = dataclasses.replace(q, golden_trajectory=({**first, "cue": cue}, *rest))
        out.append(q)
    return out


def with_retried_searches(questions, share: float, seed: int = 0) -> list:
    """Questions of which a seeded ``share`` search one golden step twice in a row.

    The repeated step keeps its query and is marked ``"retry": True``; its mode is set later by
    ``with_search_modes`` like any other step's. Format-only SFT uses this to show that a second
    search is a legal move, without teaching *when* one pays: whether a question repeats a step, and
    which, depends only on (seed, question id), never on what the first search returned."""
    if not 0.0 <= float(share) <= 1.0:
        raise ValueError(f"retry share must lie in [0, 1], got {share!r}")
    out = []
    for q in questions:
        steps = list(q.golden_trajectory)
        rng = random.Random(f"{seed}/{q.id}/retry")
        if steps and rng.random() < share:
            i = rng.randrange(len(steps))
            steps.insert(i + 1, {**steps[i], "retry": True})
            q = dataclasses.replace(q, golden_trajectory=tuple(steps))
        out.append(q)
    return out


def _search_script(env, question):
    """The golden segments of a search-dialect episode, one per ``yield`` (a generator that is
    sent each step's result; the search dialects do not need it)."""
    dialect = env.dialect
    steps = list(question.golden_trajectory)
    for i, step in enumerate(steps):
        yield dialect.search_segment(step["query"], mode=step.get("mode"),
                                     reasoning=_step_reasoning(question, steps, i), turn=i)
    yield dialect.answer_segment(question.answer, reasoning=_answer_reasoning(question, steps), turn=len(steps))


def _route_script(env, question):
    """The golden R1-Router episode: route + intermediate answer per step, stop, final answer."""
    dialect = env.dialect
    steps = list(question.golden_trajectory)
    names = getattr(env, "gold_knowledge_base_names", {})
    kbs = list(env.knowledge_bases)
    for i, step in enumerate(steps):
        label = step.get("knowledge_base", step.get("kb"))
        kb = names.get(label, label) if label is not None else kbs[0]
        if kb not in env.knowledge_bases:
            if len(kbs) != 1:
                raise ValueError(f"question {question.id!r}: golden step {i} uses knowledge base {label!r}, which "
                                 f"the environment does not have ({', '.join(kbs)}); pass gold_knowledge_base_names")
            kb = kbs[0]
        yield dialect.route_segment(step["query"], kb, reasoning=f"I still need {step['query']}.")
        yield dialect.answer_segment(str(step.get("answer")), reasoning=f"The documents state it: {step.get('answer')}.")
    if env.phase == "route":
        yield dialect.stop_segment(reasoning="The answers so far are enough to answer the question.")
    if env.phase != "final":
        raise RuntimeError(f"question {question.id!r}: expected the final-answer phase, the environment is in {env.phase!r}")
    yield dialect.answer_segment(question.answer, reasoning=_answer_reasoning(question, steps))


def _add_segment(builder, segment: str) -> None:
    ids = builder.tokenizer(segment, add_special_tokens=False)["input_ids"]
    builder.add_model_turn(ids, [0.0] * len(ids))


def _play_batch(envs, questions, builders, script) -> list[float]:
    """Play golden episodes in lockstep; each round's retrievals go to the retriever as one batch
    (``envs.step_batch``), which is what makes building thousands of examples fast."""
    from raggym.trajectory import chat_prompt_ids  # torch: on use (see the imports)

    scripts, pending = [], []
    for env, q, builder in zip(envs, questions, builders):
        prompt, _ = env.reset(options={"question": q})
        builder.add_prompt(chat_prompt_ids(builder.tokenizer, prompt))
        scripts.append(script(env, q))
        pending.append(next(scripts[-1]))
    rewards = [0.0] * len(envs)
    active = list(range(len(envs)))
    while active:
        for i in active:
            _add_segment(builders[i], pending[i])
        results = step_batch([envs[i] for i in active], [pending[i] for i in active])
        still = []
        for i, (observation, reward, terminated, truncated, info) in zip(active, results):
            q = questions[i]
            if info.get("format_error"):
                raise RuntimeError(f"question {q.id!r}: the environment rejected a golden segment: {info.get('parse_error')}")
            if terminated or truncated:
                if not terminated:
                    raise RuntimeError(f"question {q.id!r}: the golden episode was truncated "
                                       f"({info.get('truncation_reason')}) before its answer")
                if next(scripts[i], None) is not None:
                    raise RuntimeError(f"question {q.id!r}: the episode ended before its golden answer")
                rewards[i] = float(reward)
                continue
            builders[i].add_observation(observation)
            segment = next(scripts[i], None)
            if segment is None:
                raise RuntimeError(f"question {q.id!r}: the golden segments ran out before the episode ended")
            pending[i] = segment
            still.append(i)
        active = still
    return rewards


def golden_examples(questions, retriever, dialect: str, tokenizer, *, corpus=None, top_k: int = 3,
                    max_observation_tokens: int = 128, env_kwargs: dict | None = None,
                    modes: str | Sequence[str] = "golden", mode_seed: int = 0, mode_rotation: int | None = None,
                    retry_share: float = 0.0, kind_cues: Mapping[str, str] | None = None,
                    show_progress=True) -> list[dict]:
    """One supervised example per question, played through the real environment.

    Each example is ``{"token_ids", "loss_mask", "question_id", "text", "reward", "num_searches",
    "gold_hit", "modes"}``: ``loss_mask`` is 1 exactly on the model-segment tokens, ``text`` is the decoded
    sequence, ``reward`` the environment's terminal reward (exact match by default, so 1.0), and
    ``gold_hit`` whether retrieval surfaced at least one gold passage, ``modes`` each golden step's
    retrieval mode (None where the dialect names none).

    ``modes`` picks each search's retrieval mode: ``"golden"`` keeps the trajectory's own,
    a mode name (``"passage"``) fixes it, and a sequence of modes (``("passage", "graph")``) draws
    one uniformly per search, seeded by ``mode_seed`` and the question id. The last two teach the
    format and leave *when* to use which mode to RL (``with_search_modes``); ``mode_rotation``
    replaces the draw by a fixed rotation of ``modes``. ``retry_share`` repeats one search of that
    share of the questions (``with_retried_searches``, seeded by ``mode_seed``), so the data also show
    a second search of the same query, whose mode the rotation makes the other one. ``kind_cues``
    opens each question's first thought with the sentence given for its ``kind``
    (``with_kind_cues``).

    ``max_observation_tokens`` caps each observation as the rollout does
    (``RolloutConfig.max_observation_tokens``); use the same value in both. R1-Router's
    observations are whole prompts (documents included), so it needs a larger cap (about 512).

    A question without its own golden trajectory gets one derived from its evidence
    (``raggym.data.golden``: 2Wiki evidences, or its gold passages' titles, looked up in ``corpus``
    or else the retriever's corpus); one whose data determine none raises ``GoldenTrajectoryError``."""
    from raggym.trajectory import RolloutBuilder  # torch: on use (see the imports)

    _check_dialect(dialect)
    questions = list(questions)
    if not questions:
        raise ValueError("golden_examples: no questions given")
    titles_from = corpus if corpus is not None else getattr(retriever, "corpus", None)
    questions = with_golden_trajectories(questions, titles_from, need_answers=dialect == "r1_router")
    if retry_share:
        questions = with_retried_searches(questions, retry_share, mode_seed)
    questions = with_search_modes(questions, modes, mode_seed, mode_rotation)
    if kind_cues:
        questions = with_kind_cues(questions, kind_cues)
    for q in questions:
        for i, step in enumerate(q.golden_trajectory):
            if not isinstance(step, dict) or not isinstance(step.get("query"), str) or not step["query"].strip():
                raise ValueError(f"question {q.id!r}: golden_trajectory[{i}] needs a non-empty 'query' string")
    longest = max(len(q.golden_trajectory) for q in questions)
    script = _route_script if dialect == "r1_router" else _search_script
    out = []
    chunk = 64
    with tqdm(total=len(questions), desc=f"golden {dialect}", unit="ep", disable=not show_progress) as bar:
        for start in range(0, len(questions), chunk):
            part = questions[start:start + chunk]
            envs = [make_env(dialect, retriever, top_k=top_k, corpus=corpus, env_kwargs=env_kwargs,
                             longest_trajectory=longest) for _ in part]
            builders = [RolloutBuilder(tokenizer, dialect, q.id, 0, max_response_tokens=1 << 30,
                                          max_observation_tokens=max_observation_tokens) for q in part]
            rewards = _play_batch(envs, part, builders, script)
            for q, env, builder, reward in zip(part, envs, builders, rewards):
                traj = builder.finish()
                record = env.record
                items = record.steps if dialect == "r1_router" else record.turns
                retrieved = {pid for item in items for pid in item.retrieved_ids}
                out.append({
                    "token_ids": list(traj.token_ids),
                    "loss_mask": list(traj.loss_mask),
                    "question_id": q.id,
                    "text": tokenizer.decode(traj.token_ids, skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False),
                    "reward": reward,
                    "num_searches": int(record.num_retrievals),
                    "gold_hit": bool(set(q.gold_passage_ids) & retrieved),
                    "modes": [step.get("mode") for step in q.golden_trajectory],
                })
            bar.update(len(part))
    return out


# ============================================================================ loss


def masked_cross_entropy(logits, token_ids, loss_mask):
    """Token-mean cross-entropy of next-token prediction over the tokens with ``loss_mask == 1``.

    ``logits`` is ``[B, T, V]`` (position t predicts token t+1), ``token_ids`` and ``loss_mask``
    are ``[B, T]``. The loss of token t+1 counts when ``loss_mask[t+1] == 1``."""
    import torch.nn.functional as F  # on use (see the imports)

    targets = token_ids[:, 1:]
    mask = loss_mask[:, 1:].bool()
    n = int(mask.sum())
    if n == 0:
        raise ValueError("masked_cross_entropy: no token has loss_mask 1")
    return F.cross_entropy(logits[:, :-1][mask].float(), targets[mask], reduction="sum") / n


def _masked_nll_sum(model, input_ids, attention_mask, loss_mask):
    """Sum of -log p over masked targets, computing the LM head only at those positions."""
    import torch.nn.functional as F  # on use (see the imports)

    mask = loss_mask[:, 1:].bool()
    targets = input_ids[:, 1:][mask]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    head = base.get_output_embeddings()
    if decoder is not None and head is not None:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = head(hidden[:, :-1][mask])
    else:  # pragma: no cover - architectures without the decoder accessor
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1][mask]
    return F.cross_entropy(logits.float(), targets, reduction="sum")


# ============================================================================ trainer


def _check_examples(examples, max_seq_tokens: int) -> tuple[list[tuple[list[int], list[int]]], list[int], int]:
    """(rows, the example index of each row, how many were truncated); an example with no model
    token within ``max_seq_tokens`` is left out."""
    if not examples:
        raise ValueError("run_sft: no examples given")
    rows, kept, truncated = [], [], 0
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict) or "token_ids" not in ex or "loss_mask" not in ex:
            raise ValueError(f"example {i}: expected a dict with 'token_ids' and 'loss_mask'")
        ids, mask = list(ex["token_ids"]), list(ex["loss_mask"])
        if len(ids) != len(mask):
            raise ValueError(f"example {i} ({ex.get('question_id', '?')}): {len(ids)} token_ids but {len(mask)} loss_mask values")
        if any(m not in (0, 1) for m in mask):
            raise ValueError(f"example {i} ({ex.get('question_id', '?')}): loss_mask values must be 0 or 1")
        if len(ids) > max_seq_tokens:
            ids, mask, truncated = ids[:max_seq_tokens], mask[:max_seq_tokens], truncated + 1
        if sum(mask[1:]) == 0:
            continue  # nothing to learn within max_seq_tokens
        rows.append((ids, mask))
        kept.append(i)
    if not rows:
        raise ValueError(f"run_sft: no example has a model token within the first max_seq_tokens={max_seq_tokens} tokens")
    return rows, kept, truncated


def _pad(rows, pad_id: int, device):
    import torch  # on use (see the imports)

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (i, m) in enumerate(rows):
        ids[r, : len(i)] = torch.tensor(i)
        att[r, : len(i)] = 1
        mask[r, : len(m)] = torch.tensor(m)
    return ids.to(device), att.to(device), mask.to(device)


def export_policy(model, tokenizer, final_dir: Path) -> Path:
    """Save an HF directory (safetensors) atomically: a temporary sibling renamed into place."""
    final_dir = Path(final_dir)
    with atomic_directory(final_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        unsafe = [p.name for p in tmp.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        if unsafe:
            raise RuntimeError(f"export wrote unsafe weight files {unsafe}")
    return final_dir


LR_SCHEDULES = ("constant", "linear")


def lr_factor(schedule: str, step: int, total_steps: int) -> float:
    """The multiple of the base lr used by optimizer update ``step`` (0-based) of ``total_steps``.

    ``constant``: 1. ``linear``: 1 - step/total_steps, so the first update takes the full lr and
    the last lr/total_steps. A decaying lr keeps the last few batches from setting what a short
    run ends with (a 12-step format SFT at constant lr ends with whatever mode the final batches
    happened to favour)."""
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - step / total_steps
    raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")


def _indices_by_label(labels: Sequence) -> dict:
    """{label: [indices with that label, in order]}, labels in order of first appearance."""
    groups: dict = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    return groups


def balanced_order(labels: Sequence, rng: random.Random) -> list[int]:
    """A permutation of ``range(len(labels))`` that spreads every label evenly through the order.

    Position m (1-based) takes the label furthest behind its share, ``m·n_label/N - taken_label``
    (ties in a random label order), and within a label the items come in a random order. Every
    prefix then holds each label's share to within one item, so every batch sees the mix the data
    have, not a run of one kind."""
    groups = _indices_by_label(labels)
    for members in groups.values():
        rng.shuffle(members)
    names = list(groups)
    rng.shuffle(names)
    total, taken, order = len(labels), {name: 0 for name in names}, []
    for m in range(1, total + 1):
        behind = max((name for name in names if taken[name] < len(groups[name])),
                     key=lambda name: m * len(groups[name]) / total - taken[name])
        order.append(groups[behind][taken[behind]])
        taken[behind] += 1
    return order


def grouped_order(labels: Sequence, rng: random.Random) -> list[int]:
    """A permutation of ``range(len(labels))`` that keeps the items of each label together (in
    their given order) and shuffles the groups: with a batch size that is a multiple of the group
    size, every batch holds whole groups (a question's examples under every mode, say)."""
    groups = _indices_by_label(labels)
    runs = list(groups.values())
    rng.shuffle(runs)
    return [i for run in runs for i in run]


def run_sft(policy: str, examples: list[dict], out_dir, *, epochs=1, lr=5e-6, batch_size=8, grad_accum=1,
            max_seq_tokens=1024, seed=0, lora: dict | None = None, num_threads: int | None = None,
            lr_schedule: str = "constant", epoch_order=None, show_progress=True) -> dict:
    """Fine-tune ``policy`` on ``examples`` (from ``golden_examples``); see the module docstring.

    ``lr_schedule`` is ``lr_factor``'s. ``epoch_order(examples, rng) -> permutation``, if given,
    orders each epoch instead of a plain shuffle (the examples it sees are those trained on; the
    routing experiment passes ``balanced_order`` or ``grouped_order`` over a label).

    Returns ``{"policy_dir", "steps", "loss_first", "loss_last", "seconds", "examples",
    "tokens_trained", ...}`` (also written to ``<out_dir>/sft_summary.json``)."""
    import torch  # on use (see the imports)

    if int(epochs) < 1 or int(batch_size) < 1 or int(grad_accum) < 1 or int(max_seq_tokens) < 2:
        raise ValueError("epochs, batch_size and grad_accum must be >= 1 and max_seq_tokens >= 2")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    lr_factor(lr_schedule, 0, 1)  # an unknown schedule fails before the model loads
    rows, kept, truncated = _check_examples(examples, int(max_seq_tokens))
    kept_examples = [examples[i] for i in kept]
    lora_cfg = lora_settings(lora)
    if num_threads:
        torch.set_num_threads(int(num_threads))
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(seed))
    rng = random.Random(int(seed))

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model, tokenizer = load_policy(policy, device=str(device))
    if lora_cfg is not None:
        model = apply_lora(model, lora_cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(lr), weight_decay=0.0)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)

    per_step = int(batch_size) * int(grad_accum)
    steps_per_epoch = max(1, math.ceil(len(rows) / per_step))
    total_steps = steps_per_epoch * int(epochs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(lr_schedule, k, total_steps))
    metrics_path = out / "sft_metrics.jsonl"
    losses: list[float] = []
    tokens_trained = 0
    step = 0
    with open(metrics_path, "w", encoding="utf-8") as metrics, \
            tqdm(total=total_steps, desc="sft", unit="step", disable=not show_progress) as bar:
        for epoch in range(int(epochs)):
            if epoch_order is None:
                order = list(range(len(rows)))
                rng.shuffle(order)
            else:
                order = list(epoch_order(kept_examples, rng))
                if sorted(order) != list(range(len(rows))):
                    raise ValueError(f"epoch_order must return a permutation of range({len(rows)})")
            for s in range(steps_per_epoch):
                chunk = [rows[i] for i in order[s * per_step:(s + 1) * per_step]]
                if not chunk:
                    continue
                t0 = time.perf_counter()
                micro = [chunk[i:i + int(batch_size)] for i in range(0, len(chunk), int(batch_size))]
                n_tokens = sum(sum(m[1:]) for _, m in chunk)
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for mb in micro:
                    ids, att, mask = _pad(mb, pad_id, device)
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                        nll = _masked_nll_sum(model, ids, att, mask)
                    (nll / n_tokens).backward()
                    total += float(nll.detach())
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
                step_lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                schedule.step()
                step += 1
                loss = total / n_tokens
                losses.append(loss)
                tokens_trained += sum(len(i) for i, _ in chunk)
                row = {"step": step, "epoch": epoch, "loss": round(loss, 6), "model_tokens": n_tokens,
                       "sequences": len(chunk), "grad_norm": round(grad_norm, 4), "lr": float(step_lr),
                       "seconds": round(time.perf_counter() - t0, 4)}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")

    model.eval()
    if lora_cfg is not None:
        model = model.merge_and_unload()  # export plain HF weights: W + (alpha/r)·B·A, no adapters
    policy_dir = export_policy(model, tokenizer, out / "policy")
    # The caller goes on in this process (the routing study starts its RL runtime next); glibc would
    # keep the pages of the activations, gradients and optimizer state: give them back.
    del model, optimizer, schedule, params
    release_freed_memory()
    summary = {
        "policy_dir": str(policy_dir),
        "steps": step,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "seconds": round(time.perf_counter() - started, 3),
        "examples": len(rows),
        "tokens_trained": tokens_trained,
        "examples_truncated": truncated,
        "examples_skipped": len(examples) - len(rows),
        "epochs": int(epochs), "lr": float(lr), "lr_schedule": lr_schedule, "ordered": epoch_order is not None,
        "batch_size": int(batch_size), "grad_accum": int(grad_accum),
        "max_seq_tokens": int(max_seq_tokens), "seed": int(seed),
        "lora": None if lora_cfg is None else {**asdict(lora_cfg), "target_modules": list(lora_cfg.target_modules)},
        "device": str(device), "compute_dtype": "bfloat16" if cuda else "float32", "policy": str(policy),
    }
    atomic_write_json(out / "sft_summary.json", summary)
    return summary


# ============================================================================ quick evaluation


def evaluate_policy(policy, questions, retriever, dialect: str, *, corpus=None, top_k: int = 3,
                    max_observation_tokens: int = 128, max_turn_tokens: int = 96, max_response_tokens: int = 384,
                    env_kwargs: dict | None = None, num_threads: int | None = None, batch: int = 16) -> dict:
    """Greedy multi-turn episodes on ``questions`` in this process, scored by the one evaluator
    (``experiments.eval.harness.evaluate_episodes``): exact match, the share of well-formed actions
    and of episodes ending in an answer, searches per question."""
    from actors.engines.base import SamplingParams  # torch: on use (see the imports)
    from actors.engines.hf import HFEngine
    from actors.runtime import InProcessRollouts
    from envs.rollout import RolloutConfig

    _check_dialect(dialect)
    questions = list(questions)
    if not questions:
        raise ValueError("evaluate_policy: no questions given")
    engine = HFEngine(policy, num_threads=num_threads) if isinstance(policy, (str, os.PathLike)) else policy
    longest = max([len(q.golden_trajectory) for q in questions] + [4])
    config = RolloutConfig(max_response_tokens=max_response_tokens, max_turn_tokens=max_turn_tokens,
                           max_observation_tokens=max_observation_tokens, waves=1)
    runtime = InProcessRollouts(engine, engine.tokenizer, lambda qs, _: make_env(
        dialect, retriever, top_k=top_k, corpus=corpus, env_kwargs=env_kwargs, longest_trajectory=longest), config)
    started = time.perf_counter()
    episodes = []
    for i in range(0, len(questions), batch):
        episodes += evaluate_episodes(runtime, questions[i:i + batch], SamplingParams(temperature=0.0), tag="sft")[0]
    actions = [get_dialect(dialect).parse(turn["text"]) for t in episodes for turn in t["turns"]]
    n = len(questions)
    return {"questions": n, "em": sum(t["metrics"]["em"] for t in episodes) / n,
            "well_formed_share": sum(a.is_valid and a.well_formed for a in actions) / max(1, len(actions)),
            "answered_share": sum(t["metrics"]["answered"] for t in episodes) / n,
            "mean_searches": sum(t["metrics"]["retrieval_turns"] for t in episodes) / n, "model_turns": len(actions),
            "seconds": round(time.perf_counter() - started, 3)}


# ============================================================================ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.recipe.sft", description=(
        "SFT cold start on golden trajectories of the synthetic world: builds the world and its index, plays "
        "golden episodes through the real environment, fine-tunes the policy on the model tokens and writes "
        "OUT/policy (HF dir, safetensors), OUT/sft_metrics.jsonl and OUT/sft_summary.json."))
    p.add_argument("--policy", default="smollm2-135m", help="model spec for raggym.models.load_policy")
    # The live registry dict, not a copy: argparse checks membership when it parses, so a dialect
    # added with raggym.protocol.register_dialect after this parser was built is accepted too.
    p.add_argument("--dialect", default="routerag", choices=DIALECTS,
                   help="a registered dialect name (the six built-ins or one added with register_dialect)")
    p.add_argument("--synthetic-seed", type=int, default=0, help="seed of the synthetic world")
    p.add_argument("--entities", type=int, default=300, help="entities in the synthetic world")
    p.add_argument("--max-hops", type=int, default=2, help="longest bridge chain asked (1..4)")
    p.add_argument("--max-examples", type=int, default=100, help="golden episodes to train on")
    p.add_argument("--eval-questions", type=int, default=0,
                   help="held-out questions for a greedy before/after check (0: skip)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--max-seq-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--max-observation-tokens", type=int, default=128)
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    quiet = args.json
    world = generate_world(seed=args.synthetic_seed, n_entities=args.entities, max_hops=args.max_hops,
                           n_questions=args.max_examples + args.eval_questions)
    t0 = time.perf_counter()
    retriever = Retriever.build(world.corpus, openie=world.openie, show_progress=not quiet)
    index_seconds = time.perf_counter() - t0
    questions = world.questions
    train_q, eval_q = questions[: args.max_examples], questions[args.max_examples:]
    tokenizer = load_policy_tokenizer(args.policy)
    t0 = time.perf_counter()
    examples = golden_examples(train_q, retriever, args.dialect, tokenizer, corpus=world.corpus, top_k=args.top_k,
                               max_observation_tokens=args.max_observation_tokens, show_progress=not quiet)
    golden_seconds = time.perf_counter() - t0
    before = None
    if eval_q:
        before = evaluate_policy(args.policy, eval_q, retriever, args.dialect, corpus=world.corpus, top_k=args.top_k,
                                 max_observation_tokens=args.max_observation_tokens, num_threads=args.threads)
    lora = None
    if args.lora_r > 0:
        lora = {"r": args.lora_r, "alpha": args.lora_alpha,
                "target_modules": tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())}
    summary = run_sft(args.policy, examples, args.out, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                      grad_accum=args.grad_accum, max_seq_tokens=args.max_seq_tokens, seed=args.seed, lora=lora,
                      num_threads=args.threads, show_progress=not quiet)
    summary["golden"] = {"episodes": len(examples), "seconds": round(golden_seconds, 3),
                         "episodes_per_second": round(len(examples) / max(golden_seconds, 1e-9), 2),
                         "mean_tokens": round(sum(len(e["token_ids"]) for e in examples) / len(examples), 1),
                         "mean_model_tokens": round(sum(sum(e["loss_mask"]) for e in examples) / len(examples), 1),
                         "gold_hit_share": round(sum(e["gold_hit"] for e in examples) / len(examples), 3),
                         "index_seconds": round(index_seconds, 3)}
    if eval_q:
        after = evaluate_policy(summary["policy_dir"], eval_q, retriever, args.dialect, corpus=world.corpus,
                                top_k=args.top_k, max_observation_tokens=args.max_observation_tokens,
                                num_threads=args.threads)
        summary["eval"] = {"before": before, "after": after}

    atomic_write_json(Path(args.out) / "sft_summary.json", summary)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"golden episodes: {len(examples)} in {golden_seconds:.1f} s; SFT: {summary['steps']} steps in "
          f"{summary['seconds']:.1f} s, loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    if eval_q:
        for name in ("before", "after"):
            e = summary["eval"][name]
            print(f"  {name:<6} EM {e['em']:.3f}  well-formed actions {e['well_formed_share']:.3f}  "
                  f"answered {e['answered_share']:.3f}  searches/ep {e['mean_searches']:.2f}")
    print(f"policy written to {summary['policy_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
