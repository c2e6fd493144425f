"""DeepSpeed learner on CPU (gloo, fp32), in this process (world size 1).

The mechanics (ZeRO stages, accumulation, KL, teacher KL, PPO epochs, checkpoints) run on a small
randomly initialised Llama (2 layers, width 64, SmolLM2's tokenizer and vocabulary) saved as a
local model directory: the real transformers architecture and the real DeepSpeed engine, at a
size that keeps each update well under a second. The real SmolLM2-135M trains in
test_weight_sync.py, where a data-parallel LearnerGroup (two Ray actors, ZeRO-2) is checked
against the rollout engine.
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from actors.checkpoint import OPTIMIZER_FILE, STATE_FILE
from actors.learner import (
    Learner,
    LearnerConfig,
    make_train_batch,
    micro_pieces,
    policy_load_plan,
    shard_batch,
    token_logprobs,
    zero3_partitioned_loading,
)

LENGTHS = (30, 22, 26, 18)  # unequal, so per-micro-batch means differ from the global token mean
PROMPT = 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares 2 cores; one thread avoids OpenMP oversubscription
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(100, 20000, (n,), generator=g).tolist() for n in LENGTHS]
    masks = [[0] * PROMPT + [1] * (n - PROMPT) for n in LENGTHS]
    return make_train_batch(ids, masks, [1.0, -1.0, 0.5, -0.25])


WATCHED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A small random Llama with SmolLM2's tokenizer, as a local model spec."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from raggym.models import converted_checkpoint, resolve_model_spec

    tok = AutoTokenizer.from_pretrained(str(converted_checkpoint(resolve_model_spec("smollm2-135m"))))
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def snapshot(learner: Learner, names=WATCHED) -> dict[str, torch.Tensor]:
    """Full (ZeRO-3-gathered) copies of some weights, in HF names."""
    return {n: t for n, t in learner.hf_named_parameters() if names is None or n in names}


def weight_step(learner: Learner, batch, step: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """One ``update``: how far each watched weight moved, and the update's metrics."""
    before = snapshot(learner)
    metrics = learner.update(batch, step=step)
    return {n: t - before[n] for n, t in snapshot(learner).items()}, metrics


MODEL = {"path": None}  # set by the stage_runs fixture (config() is called from plain helpers)


def config(**overrides) -> LearnerConfig:
    base = {
        "model": MODEL["path"],
        "zero_stage": 2,
        "micro_batch_size": 2,
        "mini_batch_size": 4,
        "optimizer": {"lr": 1e-3, "eps": 1.0, "weight_decay": 0.0},  # eps ≫ |g|: the step scales with g
        "grad_clip": 1e6,
        "seed": 0,
    }
    base.update(overrides)
    return LearnerConfig.from_dict(base)


@pytest.fixture(scope="module")
def stage_runs(batch, tiny_model):
    """One update each with ZeRO 0 / 1 / 2 / 3 and 4 / 2 / 1 / 1 gradient-accumulation micro-batches.

    Stage 1 also carries a KL term (zero at the first step, and its gradient vanishes at
    π = π_ref) and the PathRouter teacher KL at step 0 (weight λ = 0), so its parameters must
    still take the very same step as the others. Its learner is kept for the later checks, and
    so is the ZeRO-0 one (checkpoint test). ZeRO-3 also turns on gradient checkpointing.
    """
    MODEL["path"] = tiny_model
    runs = {}
    for stage, micro in ((0, 1), (1, 2), (2, 4), (3, 4)):
        extra, b = {}, batch
        if stage == 3:
            extra = {"gradient_checkpointing": True}  # recomputation must not change the step
        if stage == 1:
            extra = {"loss": {"kl_coef": 0.1, "teacher_kl": True, "teacher_top_k": 16}}
            b = with_teacher_fields(batch)
        learner = Learner(config(zero_stage=stage, micro_batch_size=micro, **extra))
        before = snapshot(learner, names=None if stage == 0 else WATCHED)
        first = learner.update(b, step=0)
        after = snapshot(learner, names=None if stage == 0 else WATCHED)
        runs[stage] = {"first": first, "before": before, "after": after, "grad_accum": learner.grad_accum}
        if stage == 1:
            runs["learner"], runs["teacher_batch"] = learner, b
        elif stage == 0:
            runs["plain"] = learner  # kept for the checkpoint test
        else:
            del learner
            gc.collect()
    return runs


def with_teacher_fields(batch, prefix: int = 5):
    """Teacher inputs: row 0 sees exactly the student's sequence, the others 5 extra tokens first."""
    ids, attn = batch.token_ids, batch.attention_mask
    n, t = ids.shape
    t_ids = torch.zeros((n, t + prefix), dtype=torch.long)
    t_attn = torch.zeros((n, t + prefix), dtype=torch.long)
    positions = torch.full((n, t), -1, dtype=torch.long)
    for i in range(n):
        length = int(attn[i].sum())
        shift = 0 if i == 0 else prefix
        if shift:
            t_ids[i, :shift] = torch.arange(300, 300 + shift)
        t_ids[i, shift : shift + length] = ids[i, :length]
        t_attn[i, : shift + length] = 1
        positions[i, :length] = torch.arange(length) + shift
    return replace(
        batch,
        teacher_token_ids=t_ids,
        teacher_attention_mask=t_attn,
        teacher_positions=positions,
        teacher_kl_mask=batch.loss_mask.clone(),
        evidence_overlap=torch.tensor([0.0, 0.5, 0.05, 0.9]),  # rows 0 and 2 are below θ_P = 0.1
    )


def test_config_from_dict_rejects_unknown_keys_and_bad_batch_shapes():
    assert LearnerConfig().model == "smollm2-135m"
    cfg = LearnerConfig.from_dict({"zero_stage": 3, "optimizer": {"lr": 2e-6, "betas": [0.9, 0.95]}, "loss": {"clip_high": 0.28}})
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.loss.clip_high == 0.28 and cfg.zero_stage == 3
    assert cfg.resolved_dtype() == torch.float32 and cfg.resolved_device() == "cpu"
    with pytest.raises(ValueError, match="unknown"):
        LearnerConfig.from_dict({"zero_stag": 1})
    with pytest.raises(ValueError):
        make_train_batch([[1, 2, 3]], [[0, 1]], [1.0])
    with pytest.raises(ValueError):
        shard_batch(make_train_batch([[1, 2]] * 3, [[0, 1]] * 3, [0.0] * 3), 2)


def test_zero_stages_and_accumulation_give_the_same_step(stage_runs):
    assert [stage_runs[s]["grad_accum"] for s in (0, 1, 2, 3)] == [4, 2, 1, 1]
    ref = stage_runs[0]
    for stage in (1, 2, 3):
        run = stage_runs[stage]
        # Metrics are weighted like the loss, so they do not depend on the micro-batching ...
        assert run["first"]["pg_loss"] == pytest.approx(ref["first"]["pg_loss"], abs=1e-6)
        assert run["first"]["entropy"] == pytest.approx(ref["first"]["entropy"], rel=1e-5)
        # ... and neither does the mini-batch gradient (global token mean), nor the step taken.
        assert run["first"]["grad_norm"] == pytest.approx(ref["first"]["grad_norm"], rel=1e-4)
        for name in WATCHED:
            delta = run["after"][name] - run["before"][name]
            ref_delta = ref["after"][name] - ref["before"][name]
            scale = float(ref_delta.abs().max())
            assert scale > 0
            torch.testing.assert_close(delta, ref_delta, atol=1e-3 * scale, rtol=1e-3)


def assert_same_first_step(run: dict, ref: dict, keys=("pg_loss", "entropy", "loss")) -> None:
    """Two learners' first updates (``stage_runs`` entries) took the same step from the same weights."""
    for key in keys:
        assert run["first"][key] == pytest.approx(ref["first"][key], rel=1e-5, abs=1e-6), key
    assert run["first"]["grad_norm"] == pytest.approx(ref["first"]["grad_norm"], rel=1e-4)
    for name in WATCHED:
        torch.testing.assert_close(run["before"][name], ref["before"][name], atol=0, rtol=0)
        ref_delta = ref["after"][name] - ref["before"][name]
        scale = float(ref_delta.abs().max())
        assert scale > 0
        torch.testing.assert_close(run["after"][name] - run["before"][name], ref_delta, atol=1e-3 * scale, rtol=1e-3)


def one_update(cfg: LearnerConfig, batch, step: int = 0) -> tuple[Learner, dict]:
    learner = Learner(cfg)
    before = snapshot(learner)
    first = learner.update(batch, step=step)
    return learner, {"first": first, "before": before, "after": snapshot(learner)}


def test_chunked_logits_leave_the_zero3_step_unchanged(stage_runs, batch):
    # 3 positions per chunk: about 30 chunks of logits per micro-batch, each recomputed in the
    # backward inside ZeRO-3's gathered head and under gradient checkpointing of the layers.
    learner, run = one_update(config(zero_stage=3, micro_batch_size=4, gradient_checkpointing=True, logit_chunk_size=3), batch)
    assert learner.config.logit_chunk_size == 3 and stage_runs[3]["first"]["micro_batches"] == 1
    assert_same_first_step(run, stage_runs[3])


def test_chunked_logits_keep_the_reference_kl_and_teacher_terms(stage_runs):
    teacher_batch, unchunked = stage_runs["teacher_batch"], stage_runs["learner"]
    cfg = config(zero_stage=1, micro_batch_size=2, logit_chunk_size=3,
                 loss={"kl_coef": 0.1, "teacher_kl": True, "teacher_top_k": 16})
    learner = Learner(cfg)
    ids, attn = teacher_batch.token_ids, teacher_batch.attention_mask
    # the references never train: both learners' must agree, chunked or not
    torch.testing.assert_close(learner.compute_ref_logprobs(ids, attn), unchunked.compute_ref_logprobs(ids, attn), atol=1e-5, rtol=0)
    values, indices = learner.compute_teacher_topk(teacher_batch)
    want_values, want_indices = unchunked.compute_teacher_topk(teacher_batch)
    covered = teacher_batch.teacher_positions > 0
    assert torch.equal(indices[covered], want_indices[covered])
    torch.testing.assert_close(values, want_values, atol=1e-5, rtol=0)
    before = snapshot(learner)
    first = learner.update(teacher_batch, step=0)
    run = {"first": first, "before": before, "after": snapshot(learner)}
    assert_same_first_step(run, stage_runs[1], keys=("pg_loss", "entropy", "loss", "kl_loss", "teacher_kl"))


def test_micro_pieces_respect_rows_and_the_token_budget():
    assert micro_pieces([5, 5, 5, 5], 2) == [slice(0, 2), slice(2, 4)]
    assert micro_pieces([5, 5, 5], 4) == [slice(0, 3)]
    # padded tokens = rows × longest row: 2 × 10 fits 20, 3 × 10 does not; 2 × 12 does not
    assert micro_pieces([10, 3, 3, 12, 2], 4, max_tokens=20) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    assert micro_pieces([3, 3, 3, 3, 3, 3, 3], 4, max_tokens=9) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert micro_pieces([50, 1], 4, max_tokens=20) == [slice(0, 1), slice(1, 2)]  # too long for the budget: alone
    assert micro_pieces([], 4, max_tokens=20) == []
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        micro_pieces([1], 1, max_tokens=0)
    with pytest.raises(ValueError, match="max_rows"):
        micro_pieces([1], 0)


def test_a_token_budget_splits_micro_batches_without_changing_the_step(stage_runs, batch):
    # 4 rows of 18-30 tokens in one micro-batch (ZeRO-2, one accumulation step): a 60-token
    # budget allows 2 rows a pass, so the optimizer steps after 2 passes with the same gradient.
    _, run = one_update(config(zero_stage=2, micro_batch_size=4, max_tokens_per_micro_batch=60), batch)
    assert stage_runs[2]["first"]["micro_batches"] == 1 and run["first"]["micro_batches"] == 2
    assert run["first"]["optimizer_steps"] == 1.0 and run["first"]["tokens"] == float(sum(LENGTHS))
    assert_same_first_step(run, stage_runs[2])


def test_zero3_loads_the_same_weights_partitioned(stage_runs, tiny_model):
    # what each configuration loads: ZeRO-3 partitioned in the training dtype (bf16 on GPU), the
    # other stages whole in fp32 (DeepSpeed casts and keeps fp32 masters)
    assert policy_load_plan(LearnerConfig(zero_stage=3)) == (torch.float32, True)
    assert policy_load_plan(LearnerConfig(zero_stage=3, device="cuda")) == (torch.bfloat16, True)
    assert policy_load_plan(LearnerConfig(zero_stage=3, device="cuda", dtype="float32")) == (torch.float32, True)
    for stage in (0, 1, 2):
        assert policy_load_plan(LearnerConfig(zero_stage=stage, device="cuda")) == (torch.float32, False)
    # stage_runs' ZeRO-3 learner loaded partitioned and started from the very weights ZeRO-0 loaded whole
    for name in WATCHED:
        assert torch.equal(stage_runs[3]["before"][name], stage_runs[0]["before"][name])
    from transformers import AutoModelForCausalLM

    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
                 "zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}
    with zero3_partitioned_loading(ds_config):
        partitioned = AutoModelForCausalLM.from_pretrained(tiny_model)
    weight = partitioned.model.layers[0].mlp.up_proj.weight
    assert weight.numel() == 0 and weight.ds_numel == 64 * 128  # only the (here: one) rank's shard exists
    whole = AutoModelForCausalLM.from_pretrained(tiny_model)  # outside the block: a plain load again
    assert not hasattr(whole.model.layers[0].mlp.up_proj.weight, "ds_id")
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        with zero3_partitioned_loading({**ds_config, "zero_optimization": {"stage": 2}}):
            pass


def test_an_update_changes_every_parameter_and_reports_metrics(stage_runs):
    run = stage_runs[0]
    changed = [n for n in run["before"] if not torch.equal(run["before"][n], run["after"][n])]
    assert len(changed) == len(run["before"]) > 10
    first = run["first"]
    # Old logprobs were taken from the same weights: the first mini-batch is exactly on-policy.
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["approx_kl"] == pytest.approx(0.0, abs=1e-6) and first["clip_fraction"] == 0.0
    for key in ("entropy", "grad_norm", "tokens_per_s", "update_seconds", "lr"):
        assert first[key] > 0
    assert first["tokens"] == float(sum(LENGTHS)) and first["optimizer_steps"] == 1.0
    assert first["weight_version"] == 1.0


def test_kl_reference_stays_frozen_and_teacher_terms_are_computed(stage_runs, batch):
    learner, first = stage_runs["learner"], stage_runs[1]["first"]
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-8)  # π_θ = π_ref before any step
    ids, attn, mask = batch.token_ids, batch.attention_mask, batch.loss_mask.bool()
    ref = learner.compute_ref_logprobs(ids, attn)
    now = learner.compute_logprobs(ids, attn)
    assert (now - ref)[mask].abs().max() > 1e-4  # the policy moved, the reference did not:
    with torch.no_grad():
        initial = stage_runs[1]["before"]
        assert torch.equal(learner.reference.model.norm.weight, initial["model.norm.weight"])
    assert first["teacher_kl_trajectories"] == 2.0 and first["teacher_kl"] > 0


def test_teacher_logits_are_aligned_to_student_tokens(stage_runs):
    learner, tb = stage_runs["learner"], stage_runs["teacher_batch"]
    values, indices = learner.compute_teacher_topk(tb)
    for row in (0, 2):  # row 0: same sequence; row 2: five evidence tokens first
        length = int(tb.attention_mask[row].sum())
        t_len = int(tb.teacher_attention_mask[row].sum())
        with torch.no_grad():
            logits = learner.reference(input_ids=tb.teacher_token_ids[row : row + 1, :t_len]).logits[0]
        for t in (1, length // 2, length - 1):  # student token t is teacher token positions[t]
            src = int(tb.teacher_positions[row, t]) - 1
            expected = torch.topk(logits[src], 16)
            torch.testing.assert_close(values[row, t], expected.values, atol=1e-4, rtol=0)
            assert torch.equal(indices[row, t], expected.indices)


def test_compute_logprobs_matches_a_manual_forward_pass(stage_runs, batch):
    learner = stage_runs["learner"]
    lp = learner.compute_logprobs(batch.token_ids, batch.attention_mask)
    with torch.no_grad():
        logits = learner.module(input_ids=batch.token_ids[:1, : LENGTHS[0]]).logits
    manual = torch.log_softmax(logits[0, :-1], -1).gather(-1, batch.token_ids[0, 1 : LENGTHS[0], None]).squeeze(-1)
    torch.testing.assert_close(lp[0, 1 : LENGTHS[0]], manual, atol=1e-4, rtol=0)
    assert lp[0, 0] == 0 and torch.all(lp[1, LENGTHS[1] :] == 0)  # nothing predicts token 0; padding is 0
    # temperature scales the logits before the softmax
    learner.config.temperature = 0.5
    try:
        hot = learner.compute_logprobs(batch.token_ids[:1], batch.attention_mask[:1])
    finally:
        learner.config.temperature = 1.0
    expected = token_logprobs(logits / 0.5, batch.token_ids[:1, : LENGTHS[0]])
    torch.testing.assert_close(hot[0, : LENGTHS[0]], expected[0], atol=1e-4, rtol=0)


def test_batch_sizes_are_validated(stage_runs, batch):
    learner, full = stage_runs["learner"], stage_runs["teacher_batch"]
    with pytest.raises(ValueError, match="multiple"):
        learner.update(full.rows(slice(0, 3)))
    with pytest.raises(TypeError, match="advantages"):  # refused as the batch is made, before any update
        learner.update(replace(full, advantages=None))
    with pytest.raises(KeyError, match="teacher"):
        learner.update(batch)  # teacher KL is on but the batch has no teacher inputs


@pytest.mark.parametrize("kind", ["shared path", "remote URI"])
def test_kept_policies_outlive_checkpoint_pruning_and_equal_their_checkpoints_policy(tiny_model, batch, kind, tmp_path):
    """``run.keep_policy_every``: with one checkpoint kept and every 2nd policy kept, after four saves
    only step 4's checkpoint is left, but the policies of steps 2 and 4 are, each a byte copy of its
    checkpoint's ``policy/`` taken at save time (step 2 is trained once more before step 3's save)."""
    import json
    import secrets

    from actors.storage import RunStorage
    from experiments.recipe.training import KEPT_POLICY_MARKER, kept_policies, save_checkpoint

    MODEL["path"] = tiny_model
    learner = Learner(config(zero_stage=0, micro_batch_size=4))
    storage = RunStorage(str(tmp_path / "run")) if kind == "shared path" else \
        RunStorage.resolve(f"memory://raggym-test-{secrets.token_hex(4)}/run")

    def policy_files(rel):
        local = storage.download(rel)
        return {p.relative_to(local).as_posix(): p.read_bytes() for p in sorted(local.rglob("*"))
                if p.is_file() and p.name != KEPT_POLICY_MARKER}

    at_save = {}
    for step in (1, 2, 3, 4):
        if step == 3:
            learner.update(batch, step=0)  # the weights change between the kept steps
        save_checkpoint(learner, storage, step, {"weight_version": step}, keep=1, keep_policy_every=2)
        at_save[step] = policy_files(f"checkpoints/step-{step:06d}/policy")
    assert storage.list_dirs("checkpoints") == ["step-000004"]
    assert [str(p) for p in kept_policies(storage)] == [storage.uri("policies/step-000002"), storage.uri("policies/step-000004")]
    assert storage.list_dirs("policies") == ["step-000002", "step-000004"]  # no staging directory left
    for step in (2, 4):
        assert policy_files(f"policies/step-{step:06d}") == at_save[step]
        assert json.loads(storage.read_text(f"policies/step-{step:06d}/{KEPT_POLICY_MARKER}"))["step"] == step
    assert at_save[2]["model.safetensors"] != at_save[4]["model.safetensors"]
    # a copy without its marker (interrupted) is not a kept policy
    storage.write_text("policies/step-000006/config.json", "{}")
    assert len(kept_policies(storage)) == 2


def test_checkpoint_resumes_exactly_even_under_another_zero_stage(stage_runs, batch, tmp_path):
    """Save after one update (ZeRO-0), load into fresh ZeRO-2 and ZeRO-3 learners: the next steps match."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from actors.checkpoint import OPTIMIZER_FILE

    trained = stage_runs["plain"]
    trained.save_checkpoint(str(tmp_path))
    files = sorted(p.name for p in (tmp_path / "learner").iterdir()) + sorted(p.name for p in (tmp_path / "policy").iterdir())
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pkl", ".pth"))]  # safe formats only
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    saved = load_file(str(tmp_path / "learner" / OPTIMIZER_FILE))
    assert {k.split("/")[0] for k in saved} == {"fp32", "exp_avg", "exp_avg_sq"}

    policy = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"))  # plain transformers load
    current = snapshot(trained)
    assert torch.equal(policy.model.norm.weight, current["model.norm.weight"])

    resumed = {stage: Learner(config(zero_stage=stage, micro_batch_size=2)) for stage in (2, 3)}
    for learner in resumed.values():
        meta = learner.load_checkpoint(str(tmp_path))
        assert meta["adam_step"] == 1 and learner.version == trained.version == 1
        torch.testing.assert_close(snapshot(learner), current, atol=0, rtol=0)
    # Two PPO epochs over the batch: two optimizer steps, the second one off-policy.
    trained.config.ppo_epochs = 2
    a = trained.update(batch, step=1)
    assert a["optimizer_steps"] == 2.0
    assert a["approx_kl"] != 0.0 and a["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    after_a = snapshot(trained)
    for stage, learner in resumed.items():
        learner.config.ppo_epochs = 2
        b = learner.update(batch, step=1)
        assert b["pg_loss"] == pytest.approx(a["pg_loss"], abs=1e-6), stage
        assert b["approx_kl"] == pytest.approx(a["approx_kl"], rel=1e-3, abs=1e-9), stage
        after_b = snapshot(learner)
        for name in WATCHED:
            step_a = after_a[name] - current[name]
            scale = float(step_a.abs().max())
            assert scale > 0
            torch.testing.assert_close(after_b[name] - current[name], step_a, atol=1e-3 * scale, rtol=1e-3)


def test_a_resumed_learner_trains_at_its_configs_lr_not_the_saved_one(stage_runs, batch, tmp_path):
    """A study's second stage resumes with its own ``learner.optimizer.lr`` (and here its own eps):
    the config's values win over the checkpoint's, and each change is reported. Adam's step
    lr·m̂/(√v̂ + eps) is linear in lr, so from the same state twice the lr takes twice the step;
    eps = 1e-8 makes that step about lr per weight, far above the rounding of the weights."""
    stage_runs["plain"].save_checkpoint(str(tmp_path))
    saved = stage_runs["plain"].optimizer.param_groups[0]
    saved_lr, saved_eps = saved["lr"], saved["eps"]
    steps = {}
    for lr in (saved_lr, 2 * saved_lr):
        learner = Learner(config(zero_stage=0, micro_batch_size=2, optimizer={"lr": lr, "eps": 1e-8, "weight_decay": 0.0}))
        meta = learner.load_checkpoint(str(tmp_path))
        assert {(group["lr"], group["eps"]) for group in learner.optimizer.param_groups} == {(lr, 1e-8)}
        changed = meta["changed_hyperparameters"]
        assert {k.split("/")[1] for k in changed} == ({"eps"} if lr == saved_lr else {"eps", "lr"})
        assert all(v == {"saved": saved_eps, "config": 1e-8} for k, v in changed.items() if k.endswith("/eps"))
        assert all(v == {"saved": saved_lr, "config": lr} for k, v in changed.items() if k.endswith("/lr"))
        steps[lr] = weight_step(learner, batch, step=1)[0]
    for name in WATCHED:
        scale = float(steps[saved_lr][name].abs().max())
        assert scale > 0.1 * saved_lr
        torch.testing.assert_close(steps[2 * saved_lr][name], 2 * steps[saved_lr][name], rtol=1e-3, atol=1e-3 * scale)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_reset_at_step_makes_the_next_update_a_fresh_optimizers_first(stage_runs, batch, tmp_path, zero_stage):
    """``optimizer.reset_at_step``: a learner resumed from a checkpoint with AdamW moments takes, at
    that step, the very step a new learner on the same weights takes (eps = 1e-8: Adam's first step
    is about lr per weight, whatever the gradient's size), where one that keeps the moments does
    not; the reset is checkpointed, so a learner resumed after it keeps its moments, and an update
    first seen after the reset's step still resets (the step it was due at had no update)."""
    stage_runs["plain"].save_checkpoint(str(tmp_path / "trained"))  # trained: non-zero moments
    adam = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0}

    def step_of(learner, step: int) -> tuple[dict, float]:
        moved, metrics = weight_step(learner, batch, step)
        return moved, metrics["optimizer_reset"]

    def resumed(**optimizer) -> Learner:
        learner = Learner(config(zero_stage=zero_stage, micro_batch_size=2, optimizer={**adam, **optimizer}))
        assert learner.load_checkpoint(str(tmp_path / "trained"))["adam_step"] > 0
        return learner

    fresh, fresh_reset = step_of(Learner(config(model=str(tmp_path / "trained" / "policy"), zero_stage=zero_stage,
                                                micro_batch_size=2, optimizer=adam)), 1)
    reset_learner = resumed(reset_at_step=1)
    after_reset, reset = step_of(reset_learner, 1)
    kept, kept_reset = step_of(resumed(), 1)
    assert (fresh_reset, reset, kept_reset) == (0.0, 1.0, 0.0)
    for name in WATCHED:
        scale = float(fresh[name].abs().max())
        assert scale > 0.1 * adam["lr"]
        torch.testing.assert_close(after_reset[name], fresh[name], rtol=1e-4, atol=1e-4 * scale)
        assert float((kept[name] - fresh[name]).abs().max()) > 0.1 * scale, name

    reset_learner.save_checkpoint(str(tmp_path / "reset"))
    again = Learner(config(zero_stage=zero_stage, micro_batch_size=2, optimizer={**adam, "reset_at_step": 1}))
    assert again.load_checkpoint(str(tmp_path / "reset"))["optimizer_reset_at"] == 1
    assert step_of(again, 2)[1] == 0.0  # resumed after its reset: the moments stay
    assert step_of(resumed(reset_at_step=1), 3)[1] == 1.0  # due at step 1, first update at step 3


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_an_sgd_learner_resumes_adamw_weights_without_its_moments(stage_runs, batch, tmp_path, zero_stage):
    """``optimizer.name: sgd`` resumed from an AdamW checkpoint loads the weights and not the
    moments: its step equals a new SGD learner's on the checkpoint's policy, and is linear in the
    advantages (halving them halves the step, which AdamW's first step, lr·sign(g), would not). An
    SGD checkpoint carries no moments, and an AdamW learner resumed from it starts a fresh AdamW."""
    stage_runs["plain"].save_checkpoint(str(tmp_path / "adamw"))
    sgd = {"name": "sgd", "lr": 1.0, "weight_decay": 0.0}

    def resumed(optimizer, source) -> Learner:
        learner = Learner(config(zero_stage=zero_stage, optimizer=optimizer))
        learner.load_checkpoint(str(tmp_path / source))
        return learner

    fresh = weight_step(Learner(config(model=str(tmp_path / "adamw" / "policy"), zero_stage=zero_stage, optimizer=sgd)), batch)[0]
    halved = replace(batch, advantages=batch.advantages * 0.5)
    full, half = weight_step(resumed(sgd, "adamw"), batch)[0], weight_step(resumed(sgd, "adamw"), halved)[0]
    for name in WATCHED:
        scale = float(fresh[name].abs().max())
        assert scale > 1e-4, name
        torch.testing.assert_close(full[name], fresh[name], rtol=1e-4, atol=1e-4 * scale)
        torch.testing.assert_close(half[name], 0.5 * full[name], rtol=1e-3, atol=1e-3 * scale)

    sgd_learner = resumed(sgd, "adamw")
    sgd_learner.update(batch)
    sgd_learner.save_checkpoint(str(tmp_path / "sgd"))
    meta = json.loads((tmp_path / "sgd" / "learner" / STATE_FILE).read_text())
    assert (meta["optimizer"], meta["adam_step"]) == ("sgd", 0)
    assert not [k for k in load_file(str(tmp_path / "sgd" / "learner" / OPTIMIZER_FILE)) if not k.startswith("fp32/")]
    adam_again = resumed({"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0}, "sgd")
    adam_fresh = Learner(config(model=str(tmp_path / "sgd" / "policy"), zero_stage=zero_stage,
                                optimizer={"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0}))
    again, new = weight_step(adam_again, batch)[0], weight_step(adam_fresh, batch)[0]
    for name in WATCHED:
        torch.testing.assert_close(again[name], new[name], rtol=1e-4, atol=1e-4 * float(new[name].abs().max()))


def test_optimizer_config_refuses_an_unknown_name_and_a_reset_for_sgd():
    with pytest.raises(ValueError, match="adamw"):
        LearnerConfig.from_dict({"optimizer": {"name": "adam8bit"}})
    with pytest.raises(ValueError, match="SGD"):
        LearnerConfig.from_dict({"optimizer": {"name": "sgd", "reset_at_step": 5}})


def test_lora_learner_trains_only_adapters_and_syncs_merged_weights(tiny_model, batch):
    MODEL["path"] = tiny_model
    with pytest.raises(ValueError, match="LoRA with ZeRO-3"):
        Learner(config(zero_stage=3, lora={"r": 4}))
    learner = Learner(config(zero_stage=0, micro_batch_size=4, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj"]}))
    trainable = [n for n, p in learner.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "q_proj" in n for n in trainable)
    before = snapshot(learner)
    assert set(before) == set(WATCHED)  # merged weights come out under plain HF names
    learner.update(batch, step=0)  # lora_B leaves zero: the merged q_proj moves
    learner.update(batch, step=1)
    after = snapshot(learner)
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    for frozen in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(after[frozen], before[frozen]), frozen


# ----------------------------------------------------------------------------- value and direction
# The tests above compare the learner with itself; these pin its step to numbers computed by hand
# and to a plain-torch reference, so a sign error or a wrong normaliser cannot pass.


def _direction_config(tiny_model, lr: float) -> dict:
    return {"model": tiny_model, "zero_stage": 0, "micro_batch_size": 4, "mini_batch_size": 4, "shuffle": False,
            "grad_clip": 0.0, "optimizer": {"lr": lr, "weight_decay": 0.0}, "loss": {"clip_low": 0.2}}


def test_pg_loss_at_ratio_one_is_minus_the_token_weighted_advantage(tiny_model, batch):
    learner = Learner(_direction_config(tiny_model, 1e-5))
    metrics = learner.update(replace(batch))
    # ratio 1 on the first mini-batch: L = −Σ_i A_i·n_i / Σ_i n_i with n_i trained tokens per row
    n = [length - PROMPT for length in LENGTHS]
    advantages = [1.0, -1.0, 0.5, -0.25]
    assert metrics["pg_loss"] == pytest.approx(-sum(a * k for a, k in zip(advantages, n)) / sum(n), abs=1e-6)
    del learner
    gc.collect()


def test_one_update_raises_logprobs_where_the_advantage_is_positive(tiny_model, batch):
    learner = Learner(_direction_config(tiny_model, 1e-3))
    before = learner.compute_logprobs(batch.token_ids, batch.attention_mask)
    learner.update(replace(batch))
    after = learner.compute_logprobs(batch.token_ids, batch.attention_mask)
    mask = batch.loss_mask.bool()
    change = [float((after[i] - before[i])[mask[i]].mean()) for i in range(len(LENGTHS))]
    signs = [c > 0 for c in change]
    assert signs == [a > 0 for a in batch.advantages.tolist()], change
    del learner
    gc.collect()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_learner_step_equals_a_plain_torch_step(tiny_model, batch, optimizer):
    """One update (zero stage 0, one micro-batch) against torch's AdamW or SGD on
    −Σ A·m·ratio / Σ m, by hand. SGD's step is lr·g, so its lr is larger for a visible step."""
    from transformers import AutoModelForCausalLM

    lr = 1e-3 if optimizer == "adamw" else 10.0
    cfg = _direction_config(tiny_model, lr)
    learner = Learner({**cfg, "optimizer": {**cfg["optimizer"], "name": optimizer}})
    learner.update(replace(batch))
    trained = dict(learner.hf_named_parameters())

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    model.train()
    opt = (torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
           if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=lr))
    logits = model(input_ids=batch.token_ids, attention_mask=batch.attention_mask).logits.float()
    logprobs = token_logprobs(logits, batch.token_ids)
    mask = batch.loss_mask.clone()
    mask[:, 0] = 0
    ratio = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of log π
    loss = -(batch.advantages[:, None] * ratio * mask).sum() / mask.sum()
    loss.backward()
    opt.step()
    reference = dict(model.named_parameters())
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters())
    for name in WATCHED:
        assert torch.allclose(trained[name].float(), reference[name].detach(), atol=1e-5), name
        assert float((reference[name].detach() - initial[name]).abs().max()) > 1e-4, name  # a step well over atol
    assert any(not torch.equal(reference[name].detach(), p) for name, p in
               AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters() if name in WATCHED)
    del learner
    gc.collect()


# ----------------------------------------------------------------------------- speed options
# Prompt sharing, trimmed rows and π_old taken from the update's own forward must not change the
# step. The optimizer is AdamW with eps = 1 ≫ |g| and lr = 1, so a parameter moves by about its
# gradient (g / (|g| + 1)) and equal weights after a step mean equal gradients.


def grouped_batch(prompt: int = 12, tails=(9, 14, 6, 11)):
    """Two prompts of ``prompt`` tokens, each with two continuations; an observation masked out."""
    g = torch.Generator().manual_seed(3)
    ids, masks = [], []
    for group in range(2):
        shared = torch.randint(100, 20000, (prompt,), generator=g).tolist()
        for tail in tails[2 * group : 2 * group + 2]:
            ids.append(shared + torch.randint(100, 20000, (tail,), generator=g).tolist())
            mask = [0] * prompt + [1] * tail
            mask[prompt + 2 : prompt + 4] = [0, 0]  # retrieved text inside the response
            masks.append(mask)
    order = [0, 2, 1, 3]  # groups interleaved: the learner has to bring them together
    return make_train_batch([ids[i] for i in order], [masks[i] for i in order], [1.0, -0.5, -1.0, 0.75])


def speed_config(tiny_model, **overrides) -> dict:
    base = {"model": tiny_model, "zero_stage": 0, "micro_batch_size": 2, "mini_batch_size": 4, "shuffle": False,
            "grad_clip": 1e6, "optimizer": {"lr": 1.0, "eps": 1.0, "weight_decay": 0.0},
            "loss": {"clip_low": 0.2, "kl_coef": 0.1, "entropy_coef": 0.01}, "min_shared_prefix": 8}
    base.update(overrides)
    return base


def run_update(cfg: dict, batch) -> tuple[dict, dict]:
    learner = Learner(cfg)
    metrics = learner.update(replace(batch))
    weights = dict(learner.hf_named_parameters())
    del learner
    gc.collect()
    return metrics, weights


def assert_same_step(a: tuple[dict, dict], b: tuple[dict, dict], keys=("pg_loss", "kl_loss", "entropy", "loss")):
    (ma, wa), (mb, wb) = a, b
    for k in keys:
        assert ma[k] == pytest.approx(mb[k], abs=1e-5), k
    for name, tensor in wa.items():
        torch.testing.assert_close(wb[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_prompt_sharing_and_pi_old_from_the_update_forward_leave_the_step_unchanged(tiny_model):
    batch = grouped_batch()
    g = torch.Generator().manual_seed(4)
    batch.ref_logprobs = batch.loss_mask * (torch.randn(batch.loss_mask.shape, generator=g) * 0.3 - 9.0)
    plain = run_update(speed_config(tiny_model, share_prompts=False, old_logprobs="recompute"), batch)
    fast = run_update(speed_config(tiny_model), batch)
    assert_same_step(plain, fast)
    assert fast[0]["old_logprobs_recomputed"] == 0.0 and plain[0]["old_logprobs_recomputed"] == 1.0
    assert fast[0]["seconds_old_logprobs"] == 0.0 and plain[0]["seconds_old_logprobs"] > 0
    # the prompt ran once per group: 2·12 prompt tokens fewer than the 4 padded rows' real tokens
    assert fast[0]["tokens_computed"] == fast[0]["tokens"] - 2 * 12
    assert plain[0]["tokens_computed"] == plain[0]["tokens"]


def test_rollout_logprobs_stand_in_for_pi_old_only_while_the_drift_is_small(tiny_model):
    """Two PPO epochs: the second uses the rollout's logprobs, unless the first mini-batch's drift
    exceeds ``max_logprob_drift``; then π_old is recomputed before the first optimizer step."""
    batch = grouped_batch()
    exact = run_update(speed_config(tiny_model, ppo_epochs=2, share_prompts=False, old_logprobs="recompute"), batch)
    probe = Learner(speed_config(tiny_model))
    at_rollout = probe.compute_logprobs(batch.token_ids, batch.attention_mask)
    del probe
    gc.collect()
    mask = batch.loss_mask > 0
    same = run_update(speed_config(tiny_model, ppo_epochs=2), replace(batch, sampled_logprobs=at_rollout))
    assert_same_step(exact, same)
    assert same[0]["old_logprobs_recomputed"] == 0.0 and same[0]["logprob_drift_max"] < 1e-4
    off = run_update(speed_config(tiny_model, ppo_epochs=2), replace(batch, sampled_logprobs=at_rollout + 0.5 * mask))
    assert off[0]["old_logprobs_recomputed"] == 1.0 and off[0]["logprob_drift_mean"] == pytest.approx(0.5, abs=1e-4)
    assert_same_step(exact, off)


def teacher_only_config(tiny_model, micro: int) -> dict:
    return speed_config(tiny_model, micro_batch_size=micro, loss={
        "teacher_kl": True, "teacher_top_k": 16, "teacher_max_weight": 0.5, "teacher_warmup_steps": 20})


def test_teacher_kl_is_the_mean_over_the_batchs_evidence_poor_trajectories(tiny_model, batch):
    """PathRouter: λ · 1/|I_low| Σ_{i∈I_low} KL_i over the whole batch (Eq. of the paper), checked
    against the formula on full logits in plain torch, whatever the micro-batch split."""
    from transformers import AutoModelForCausalLM

    from raggym.algorithms.losses import teacher_topk, topk_forward_kl

    tb = with_teacher_fields(batch)
    tb.advantages = torch.zeros(4)  # the teacher term alone moves the weights
    tb.evidence_overlap = torch.tensor([0.5, 0.5, 0.05, 0.9])  # one evidence-poor row of four (rare)
    lam = 0.5  # step 20 ≥ W: λ = λ̄
    runs = {}
    for micro in (1, 2, 4):
        learner = Learner(teacher_only_config(tiny_model, micro))
        runs[micro] = learner.update(replace(tb), step=20), dict(learner.hf_named_parameters())
        del learner
        gc.collect()
    for micro in (2, 4):  # micro 1 is GA 4: the old per-micro-batch mean weighted it by 1/4
        assert_same_step(runs[1], runs[micro], keys=("teacher_kl", "loss"))
    metrics = runs[1][0]
    assert metrics["teacher_kl_trajectories"] == 1.0
    assert metrics["teacher_loss"] == pytest.approx(lam * metrics["teacher_kl"], rel=1e-5)  # no 1/GA shrink

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, eps=1.0, weight_decay=0.0)
    student = model(input_ids=tb.token_ids, attention_mask=tb.attention_mask).logits
    student = torch.nn.functional.pad(student[:, :-1], (0, 0, 1, 0))  # logits that predict token t
    t_logits = teacher(input_ids=tb.teacher_token_ids, attention_mask=tb.teacher_attention_mask).logits
    src = (tb.teacher_positions - 1).clamp(min=0)
    values, indices = teacher_topk(t_logits.gather(1, src[..., None].expand(-1, -1, t_logits.shape[-1])), 16)
    per_pos = topk_forward_kl(student, values, indices)
    mask = tb.loss_mask.clone()
    mask[:, 0] = 0
    span = tb.teacher_kl_mask * (tb.teacher_positions > 0) * mask
    per_traj = (per_pos * span).sum(-1) / span.sum(-1)
    poor = tb.evidence_overlap < 0.1
    loss = lam * per_traj[poor].mean()
    assert float(per_traj[poor].mean().detach()) == pytest.approx(metrics["teacher_kl"], rel=1e-4)
    loss.backward()
    opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(runs[1][1][name], p.detach(), atol=1e-5, rtol=0, msg=name)


def test_theta_p_is_one_key_for_the_routes_and_the_teacher_selection():
    from pathlib import Path

    from experiments.recipe.config import ConfigError, load_config
    from actors.runtime import learner_config

    tiny = str(Path(__file__).resolve().parents[1] / "experiments" / "configs" / "pathrouter_tiny.yaml")
    with pytest.raises(ConfigError, match="reward.evidence_threshold"):
        load_config(tiny, ["learner.loss.evidence_threshold=0.2"])
    cfg = load_config(tiny, ["reward.evidence_threshold=0.3"])
    assert LearnerConfig.from_dict(learner_config(cfg)).loss.evidence_threshold == 0.3
    # the trainer's own keys come from their sections
    cfg = load_config(tiny, ["policy.model=tiny-llama", "rollout.temperature=0.7", "run.seed=5"])
    learner = LearnerConfig.from_dict(learner_config(cfg))
    assert (learner.model, learner.temperature, learner.seed) == ("tiny-llama", 0.7, 5)
    assert learner.loss.evidence_threshold == LearnerConfig().loss.evidence_threshold  # pathrouter_tiny sets no θ_P


def test_dual_clip_reaches_the_learners_loss(tiny_model):
    """verl's dual clip only bites at ratios above c with Â < 0: a second PPO epoch after a large
    first step has such tokens, so the two settings must give different second steps."""
    batch = grouped_batch()
    common = dict(ppo_epochs=2, mini_batch_size=2, old_logprobs="recompute", share_prompts=False)
    plain = run_update(speed_config(tiny_model, **common), batch)
    dual = run_update(speed_config(tiny_model, **common, loss={"clip_low": 0.2, "dual_clip": True, "clip_ratio_c": 1.5}), batch)
    assert dual[0]["clip_fraction_lower"] > 0
    assert dual[0]["pg_loss"] < plain[0]["pg_loss"]  # capping a loss term can only lower it


# ----------------------------------------------------------------------------- mode entropy bonus


def _choice_entropies(model_path: str, batch, marks) -> list[float]:
    """Entropy of the tiny model's distribution for each marked token, from a plain forward."""
    from transformers import AutoModelForCausalLM

    from raggym.algorithms.losses import entropy_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.token_ids, attention_mask=batch.attention_mask).logits.float()
    entropy = entropy_from_logits(logits)  # entry t − 1 is the distribution token t was drawn from
    return [float(entropy[row, t - 1]) for row, t in marks]


def test_mode_entropy_bonus_is_the_choices_entropy_over_the_trained_tokens(tiny_model, batch, tmp_path):
    marks = [(0, PROMPT + 2), (1, PROMPT + 5), (2, PROMPT + 2)]  # row 3 chose no mode
    b = replace(batch, advantages=torch.zeros(len(LENGTHS)), mode_choice_mask=torch.zeros_like(batch.loss_mask))
    for row, t in marks:
        b.mode_choice_mask[row, t] = 1.0
    before = _choice_entropies(tiny_model, b, marks)
    coef = 0.5
    learner = Learner({**_direction_config(tiny_model, 1e-3), "loss": {"clip_low": 0.2, "mode_entropy_coef": coef}})
    metrics = learner.update(replace(b))
    trained = sum(length - PROMPT for length in LENGTHS)  # token-mean: every trained token counts
    # L = PG − c_M · Σ_choices H / Σ_trained 1, with PG = 0 (zero advantages)
    assert metrics["pg_loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["mode_entropy_term"] == pytest.approx(sum(before) / trained, rel=1e-4)
    assert metrics["loss"] == pytest.approx(-coef * sum(before) / trained, rel=1e-4)
    assert metrics["mode_entropy"] == pytest.approx(sum(before) / len(marks), rel=1e-4)
    assert metrics["mode_choices"] == len(marks)
    learner.save_checkpoint(str(tmp_path), policy=True)
    after = _choice_entropies(str(tmp_path / "policy"), b, marks)
    assert sum(after) > sum(before) + 1e-3, (before, after)  # the bonus spreads the choices out
    with pytest.raises(KeyError, match="mode_choice_mask"):
        learner.update(replace(b, mode_choice_mask=None))
    del learner
    gc.collect()


def _mode_pg_gains(tiny_model, b, marks, loss: dict) -> tuple[list[float], dict]:
    """One update of a fresh learner (the same initial weights each time) with ``loss``: the change
    of log π at each of ``marks``, and the update's metrics."""
    learner = Learner({**_direction_config(tiny_model, 1e-3), "loss": {"clip_low": 0.2, **loss}})
    before = learner.compute_logprobs(b.token_ids, b.attention_mask)
    metrics = learner.update(replace(b))
    after = learner.compute_logprobs(b.token_ids, b.attention_mask)
    del learner
    gc.collect()
    return [float(after[row, t] - before[row, t]) for row, t in marks], metrics


def test_mode_pg_term_moves_the_mode_choices_with_their_advantage(tiny_model, batch):
    marks = [(0, PROMPT + 2), (1, PROMPT + 5), (2, PROMPT + 2)]  # advantages +1, −1, +0.5; row 3 chose no mode
    b = replace(batch, mode_choice_mask=torch.zeros_like(batch.loss_mask))
    for row, t in marks:
        b.mode_choice_mask[row, t] = 1.0
    k = 4.0
    plain, _ = _mode_pg_gains(tiny_model, b, marks, {})
    with_term, metrics = _mode_pg_gains(tiny_model, b, marks, {"mode_pg_coef": k})
    # ratio 1: L_mode = −Σ_choices Â / 3 = −(1 − 1 + 0.5) / 3; the loss adds k·L_mode to the PG term
    assert metrics["mode_pg_term"] == pytest.approx(-0.5 / 3, abs=1e-6)
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + k * (-0.5 / 3), abs=1e-6)
    assert metrics["mode_pg_clip_fraction"] == 0.0
    # the choices with a positive advantage (rows 0 and 2) rise more than the PG term alone raises
    # them, and the one with a negative advantage (row 1) falls more
    assert with_term[0] > plain[0] and with_term[2] > plain[2], (plain, with_term)
    assert with_term[1] < plain[1], (plain, with_term)
    # the same term with its sign negated (named explicitly: a negative coefficient switches nothing on)
    # pushes the other way, so the comparison above would fail for it
    negated, _ = _mode_pg_gains(tiny_model, b, marks, {"terms": ["clipped_pg", "mode_pg"], "mode_pg_coef": -k})
    assert negated[0] < plain[0] and negated[2] < plain[2] and negated[1] > plain[1], (plain, negated)
    learner = Learner({**_direction_config(tiny_model, 1e-3), "loss": {"clip_low": 0.2, "mode_pg_coef": k}})
    with pytest.raises(KeyError, match="mode_choice_mask"):  # the term reads the mode mask: a batch without it is refused
        learner.update(replace(b, mode_choice_mask=None))
    del learner
    gc.collect()


def _rollout_logprobs(tiny_model, batch) -> torch.Tensor:
    """The log-probs an engine equal to the learner would have sampled with."""
    probe = Learner(speed_config(tiny_model))
    at_rollout = probe.compute_logprobs(batch.token_ids, batch.attention_mask)
    del probe
    gc.collect()
    return at_rollout


def test_masked_rollout_correction_drops_rejected_tokens_from_the_loss_and_its_denominator(tiny_model):
    """Issue #68: three tokens whose engine log-prob is 5 nats above the learner's (ρ = e^-5) are
    rejected by the token mask. The step must equal one where those tokens were never trained: a
    rejected token still in the denominator (slime #657) would shrink every other token's share."""
    batch = grouped_batch()
    at_rollout = _rollout_logprobs(tiny_model, batch)
    far = torch.zeros_like(at_rollout)
    far[0, 13] = far[0, 16] = far[2, 20] = 5.0
    assert bool((batch.loss_mask[far > 0] == 1).all())
    correction = {"level": "token", "kind": "mask", "threshold": 2.0}
    corrected = run_update(speed_config(tiny_model, old_logprobs="recompute", loss={
        "clip_low": 0.2, "entropy_coef": 0.01, "rollout_correction": correction}),
        replace(batch, sampled_logprobs=at_rollout + far))
    never_trained = run_update(speed_config(tiny_model, old_logprobs="recompute", loss={"clip_low": 0.2, "entropy_coef": 0.01}),
                               replace(batch, loss_mask=batch.loss_mask * (far == 0)))
    assert_same_step(corrected, never_trained, keys=("pg_loss", "entropy", "loss"))
    trained = float(batch.loss_mask[:, 1:].sum())
    assert corrected[0]["rollout_is/changed_share"] == pytest.approx(3 / trained)
    assert corrected[0]["rollout_is/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert corrected[0]["rollout_is/kl_k1"] == pytest.approx(5 * 3 / trained, abs=1e-4)  # E[log π_rollout − log π_old]


def test_truncated_rollout_correction_weighs_a_sequences_pg_loss(tiny_model):
    """The engine gave row 0's tokens a quarter of the learner's probability each, so the row's
    sequence weight Π ρ = 4^n is capped at C = 2. At ρ_θ = 1 (one optimizer step) w·(−Â·ρ_θ) = −(2Â)·ρ_θ: the step equals one with row 0's
    advantage doubled and no correction."""
    batch = grouped_batch()
    at_rollout = _rollout_logprobs(tiny_model, batch)
    quarter = torch.zeros_like(at_rollout)
    quarter[0] = -math.log(4.0) * batch.loss_mask[0]
    loss = {"clip_low": 0.2, "entropy_coef": 0.01}
    corrected = run_update(speed_config(tiny_model, old_logprobs="recompute", loss={
        **loss, "rollout_correction": {"level": "sequence", "kind": "truncate", "threshold": 2.0}}),
        replace(batch, sampled_logprobs=at_rollout + quarter))
    doubled = batch.advantages.clone()
    doubled[0] *= 2
    reference = run_update(speed_config(tiny_model, old_logprobs="recompute", loss=loss), replace(batch, advantages=doubled))
    assert_same_step(corrected, reference, keys=("pg_loss", "entropy", "loss"))
    assert corrected[0]["rollout_is/weight_max"] == pytest.approx(2.0)
    rows_tokens = batch.loss_mask[:, 1:].sum(-1)
    assert corrected[0]["rollout_is/changed_share"] == pytest.approx(float(rows_tokens[0] / rows_tokens.sum()))
