import json
import subprocess
import sys

import pytest

from experiments.cli import build_parser, main
from raggym.data import load_corpus, load_questions
from raggym.data.splits import hold_out
from raggym.data.synthetic import generate_world

SUBCOMMANDS = ["index", "retrieve", "train", "eval", "serve", "demo", "bench"]


def test_console_script_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "experiments.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS + ["synth"])
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([name, "--help"])
    assert exc.value.code == 0
    assert "usage: raggym " + name in capsys.readouterr().out


def test_serve_without_index_fails_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve"])
    assert exc.value.code == 2
    assert "--index" in capsys.readouterr().err


def test_demo_json_reports_world_statistics(capsys):
    assert main(["demo", "--world-only", "--json", "--entities", "300"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entities"] >= 300 and stats["passages"] > stats["entities"] and stats["questions"] == 200
    assert set(stats["questions_by_kind"]) == {"bridge", "comparison", "single"}
    assert stats["example_questions"]


def test_demo_defaults_are_the_measured_routing_settings():
    """make demo runs what docs/results.md measured on three seeds: an even, question-blind SFT mode
    prior written once per mode, and RL rollouts at temperature 0.7 (a user's override still wins)."""
    from experiments.demo import demo_settings

    settings = demo_settings(build_parser().parse_args(["demo"]))
    assert (settings.sft_modes, settings.sft_mode_sampling, settings.sft_order, settings.sft_lr_schedule) == (
        "passage,graph", "every", "per-question", "linear")
    assert (settings.stage1_steps, settings.stage2_steps, settings.eval_samples) == (5, 1, 0)
    assert settings.overrides == ("rollout.temperature=0.7",)
    settings = demo_settings(build_parser().parse_args(["demo", "--temperature", "1", "rollout.temperature=0.9"]))
    assert settings.overrides == ("rollout.temperature=1.0", "rollout.temperature=0.9")  # the last one is applied


def test_demo_refuses_a_bad_sft_choice_in_one_line_and_leaves_out_alone(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", "--sft-order", "alphabetical"])
    assert exc.value.code == 2
    assert "--sft-order" in capsys.readouterr().err
    earlier = tmp_path / "earlier_demo"
    (earlier / "report.md").parent.mkdir()
    (earlier / "report.md").write_text("an earlier run's report")
    assert main(["demo", "--sft-modes", "passage,telepathy", "--out", str(earlier)]) == 2
    assert "telepathy" in capsys.readouterr().err
    assert (earlier / "report.md").read_text() == "an earlier run's report"  # not replaced by a run that cannot start


def test_synth_writes_loadable_files(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path / "w"), "--entities", "120", "--questions", "10", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    corpus = load_corpus(tmp_path / "w" / "corpus.jsonl")
    assert len(corpus) == stats["passages"]
    assert len(load_questions(tmp_path / "w" / "questions.jsonl", corpus)) == 10


def test_synth_writes_the_routing_world_the_demo_learns_on(tmp_path, capsys):
    out = tmp_path / "routing"
    assert main(["synth", "--task", "routing", "--out", str(out), "--entities", "120", "--questions", "40",
                 "--heldout", "8", "--seed", "3", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["split"] == {"train": 32, "heldout": 8}
    # the demo and the routing study build their world in memory (build_task): the same world, split the same way
    world = generate_world(3, n_entities=120, n_questions=40, task="routing")
    corpus = load_corpus(out / "corpus.jsonl")
    assert [(p.id, p.text) for p in corpus] == [(p.id, p.text) for p in world.corpus]
    written = {name: load_questions(out / f"{name}_questions.jsonl", corpus) for name in ("train", "heldout")}
    train, heldout = hold_out(world.questions, 8, 3)
    assert [(q.id, q.question, q.kind) for q in written["heldout"]] == [(q.id, q.question, q.kind) for q in heldout]
    assert [q.id for q in written["train"]] == [q.id for q in train]
    assert {q.kind for q in written["train"]} == {"graph_only", "direct"}
    assert main(["synth", "--task", "routing", "--out", str(tmp_path / "bad"), "--entities", "120",
                 "--questions", "40", "--heldout", "41"]) == 2
    assert "heldout" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_train_rejects_a_missing_config_in_one_line(capsys, tmp_path):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_bad_arguments_give_one_line_errors(capsys, tmp_path):
    assert main(["bench", "no-such-bench"]) == 2
    assert "no benchmark named 'no-such-bench'" in capsys.readouterr().err
    assert main(["synth", "--out", str(tmp_path / "x"), "--max-hops", "9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_hops" in err
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
