"""Learner checkpoints in safe formats: the policy as a Hugging Face directory, the optimizer as
safetensors + JSON.

* ``save_policy_hf(learner, out_dir)`` writes ``config.json``, ``generation_config.json``,
  ``model.safetensors`` and the tokenizer — loadable by ``transformers`` and by vLLM, and usable
  as a raggym model spec (a local directory).
* ``save_learner_state(learner, out_dir)`` / ``load_learner_state(learner, in_dir)`` write and
  restore what an exact resume needs from the learner: for every trainable weight, in HF names
  and *unpartitioned*, its fp32 master value and AdamW's ``exp_avg`` / ``exp_avg_sq`` (SGD keeps
  none, so its checkpoint holds the weights alone); plus the
  AdamW step, the trainer step of its last reset (``reset_adam_state``), the param-group
  hyperparameters (for the record: on resume the config's win) and the learner's weight version
  (which also seeds the mini-batch shuffling) in ``learner_state.json``. Because the state is
  stored whole, a run can resume with another ZeRO stage or another number of learners.

No pickle anywhere (DeepSpeed's own ``save_checkpoint`` uses ``torch.save``). Under ZeRO-3 every
rank must call these functions together (parameters are gathered collectively); rank 0 writes,
every rank reads. The trainer's own state (step, data cursor, RNG) is the recipe's business, and
so is making a whole checkpoint appear at once: write it into ``raggym.atomic.atomic_directory``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from raggym.atomic import atomic_write_json

OPTIMIZER_FILE = "learner_optimizer.safetensors"
STATE_FILE = "learner_state.json"
log = logging.getLogger(__name__)
_MOMENTS = ("exp_avg", "exp_avg_sq")
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def _is_zero(learner) -> bool:
    return int(learner.config.zero_stage) > 0


def _base_optimizer(learner):
    """The torch optimizer that owns the Adam state (ZeRO wraps it; stage 0 is the optimizer itself)."""
    return learner.optimizer.optimizer if _is_zero(learner) else learner.optimizer


def _moments(learner) -> tuple[str, ...]:
    """The optimizer state a checkpoint carries per weight: AdamW's two moments; none for SGD."""
    return _MOMENTS if learner.config.optimizer.name == "adamw" else ()


def _adam_step(learner) -> int:
    for state in _base_optimizer(learner).state.values():
        if "step" in state:
            step = state["step"]
            return int(step.item() if torch.is_tensor(step) else step)
    return 0


def _ensure_adam_state(learner) -> None:
    """Give a learner that has not stepped yet zero Adam moments, so a saved state can be loaded.

    torch's AdamW creates its state lazily at the first step, and DeepSpeed's ZeRO-1/2 optimizer
    links each parameter to its slice of that state only then (``_lazy_init_hp_params_optimizer_
    state``, called here when present).
    """
    base = _base_optimizer(learner)
    owners = [p for group in base.param_groups for p in group["params"]]
    # ZeRO-3 hands its flat fp32 partitions to the torch optimizer only during step().
    owners += list(getattr(learner.optimizer, "fp32_partitioned_groups_flat", []) or [])
    for p in owners:
        state = base.state[p]
        state.setdefault("step", torch.tensor(0.0))
        for key in _MOMENTS:
            if key not in state:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    link = getattr(learner.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if _is_zero(learner) and callable(link):
        link()


def reset_adam_state(learner) -> None:
    """Zero AdamW's moments and step count in place: the next ``step()`` is a fresh optimizer's
    first (moments of that one gradient, bias correction at step 1). Weights and hyperparameters
    stay. Under ZeRO the torch optimizer's state lives on flat fp32 partitions; zeroing them in
    place keeps DeepSpeed's links to those tensors."""
    for state in _base_optimizer(learner).state.values():
        for key in _MOMENTS:
            if torch.is_tensor(state.get(key)):
                state[key].zero_()
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def save_policy_hf(learner, out_dir: str | Path) -> Path | None:
    """Write the current policy as an HF directory (rank 0); returns the path there, ``None`` elsewhere."""
    from transformers import AutoModelForCausalLM

    named = [(n, t) for n, t in learner.hf_named_parameters()]  # collective under ZeRO-3
    if learner.rank != 0:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = learner.module.get_base_model() if hasattr(learner.module, "get_base_model") else learner.module
    config = source.config
    model = AutoModelForCausalLM.from_config(config, dtype=named[0][1].dtype if named else None)
    missing, unexpected = model.load_state_dict(dict(named), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"policy export does not match the architecture: missing={missing[:5]} unexpected={unexpected[:5]}")
    if getattr(source, "generation_config", None) is not None:
        model.generation_config = source.generation_config
    model.save_pretrained(out, safe_serialization=True)
    learner.tokenizer.save_pretrained(out)
    return out


def save_learner_state(learner, out_dir: str | Path) -> Path | None:
    """Write the optimizer state and learner metadata (rank 0 writes; all ranks must call)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    base = _base_optimizer(learner)
    moments = _moments(learner)
    for name, param in learner.module.named_parameters():
        if not param.requires_grad:
            continue
        if _is_zero(learner):
            values = {
                "fp32": safe_get_full_fp32_param(param),
                **{k: safe_get_full_optimizer_state(param, k) for k in moments},
            }
        else:
            state = base.state.get(param, {})
            values = {"fp32": param.detach(), **{k: state.get(k) for k in moments}}
        if learner.rank == 0:
            for kind, value in values.items():
                if value is not None:
                    tensors[f"{kind}/{name}"] = value.detach().float().cpu().contiguous()
    if learner.rank != 0:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / OPTIMIZER_FILE))
    meta = {
        "version": int(learner.version),
        "optimizer": learner.config.optimizer.name,
        "adam_step": _adam_step(learner),
        "optimizer_reset_at": learner.optimizer_reset_at,
        "zero_stage": int(learner.config.zero_stage),
        "world_size": int(learner.world_size),
        "param_groups": [
            {k: (list(g[k]) if isinstance(g[k], tuple) else float(g[k])) for k in _HYPERPARAMETERS if k in g}
            for g in learner.optimizer.param_groups
        ],
        "config": learner.config.to_dict(),
    }
    atomic_write_json(out / STATE_FILE, meta)  # written last and whole: its presence means the state is complete
    return out


def load_learner_state(learner, in_dir: str | Path) -> dict:
    """Restore weights, AdamW moments and step and version; returns the metadata. A learner whose
    optimizer keeps no moments (``optimizer.name: sgd``) takes the weights and version only.

    The hyperparameters (lr, betas, eps, weight decay) stay as this run's config set them; the
    metadata's ``changed_hyperparameters`` lists those that differ from the saved ones.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from safetensors.torch import load_file

    src = Path(in_dir)
    meta = json.loads((src / STATE_FILE).read_text())
    tensors = load_file(str(src / OPTIMIZER_FILE))
    step = int(meta["adam_step"])
    if step > 0 and not _moments(learner):
        log.info("%s holds AdamW moments; this learner's %s optimizer has none, so only the weights load",
                 src, learner.config.optimizer.name)
        step = 0
    if step > 0:
        _ensure_adam_state(learner)
    base = _base_optimizer(learner)
    zero3 = int(learner.config.zero_stage) == 3
    for name, param in learner.module.named_parameters():
        if not param.requires_grad:
            continue
        fp32 = tensors.get(f"fp32/{name}")
        if fp32 is None:
            raise KeyError(f"learner state in {src} lacks weight {name!r}")
        moments = {k: tensors.get(f"{k}/{name}") for k in _MOMENTS}
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if learner.rank == 0:
                    param.data.copy_(fp32.to(param.dtype))
        else:
            with torch.no_grad():
                param.data.copy_(fp32.to(device=param.device, dtype=param.dtype))
        if _is_zero(learner):
            safe_set_full_fp32_param(param, fp32.to(learner.device))
            for k, v in moments.items():
                if v is not None and step > 0:
                    safe_set_full_optimizer_state(param, v.to(learner.device), k)
        elif step > 0:
            state = base.state[param]
            for k, v in moments.items():
                if v is not None:
                    state[k] = v.to(device=param.device, dtype=param.dtype).clone()
    for state in base.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step)) if torch.is_tensor(state["step"]) else step
    # The optimizer was built from this run's config, and its hyperparameters win: a run resumed
    # with a new ``learner.optimizer.lr`` (a study's second stage) trains at that lr. The saved
    # values are only compared, so that a change is said, not silent.
    changed = {}
    for index, (group, saved) in enumerate(zip(learner.optimizer.param_groups, meta["param_groups"])):
        for k, v in saved.items():
            now = list(group[k]) if isinstance(group.get(k), tuple) else group.get(k)
            if now is not None and now != v:
                changed[f"group{index}/{k}"] = {"saved": v, "config": now}
    if changed:
        log.warning("resuming from %s with the config's optimizer hyperparameters, not the saved ones: %s", src, changed)
    meta["changed_hyperparameters"] = changed
    learner.version = int(meta["version"])
    learner.optimizer_reset_at = meta.get("optimizer_reset_at")  # a state saved before the reset existed: None
    return meta


__all__ = ["OPTIMIZER_FILE", "STATE_FILE", "load_learner_state", "reset_adam_state", "save_learner_state",
           "save_policy_hf"]
