"""Tests for inference.model_loader: resolving models, converting GGUF, reading weights.

The packaged SmolLM2 GGUF is converted once per session into a temporary cache and
checked against transformers' independent GGUF loader. Small random Llama, Qwen2 and
Qwen3 models are written as Hugging Face directories and as GGUF files (with
llama.cpp's Q/K row permutation for Llama) and must come back unchanged.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from inference.errors import ModelLoadError, UnsupportedArchitectureError
from inference.model_loader import (
    check_architecture,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from inference.model_loader import gguf_cache, gguf_convert, sources
from inference.model_loader.gguf_tensors import unpermute_rope_rows

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A session-wide TESSERA_CACHE_DIR, so the packaged model is converted once."""
    path = tmp_path_factory.mktemp("tessera_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def packaged(cache_dir):
    started = time.perf_counter()
    resolved = resolve_model("SmolLM2-135M-Instruct")
    return resolved, time.perf_counter() - started


@pytest.fixture(scope="session")
def packaged_gguf() -> Path:
    return sources.find_packaged_gguf()


def _tiny_config(arch: str, **overrides):
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6)
    common.update(overrides)
    cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config,
           "Qwen3ForCausalLM": transformers.Qwen3Config}[arch]
    config = cls(**common)
    config.architectures = [arch]
    return config


def _tiny_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_config(arch, **overrides))
    with torch.no_grad():  # norms start at exactly 1 and biases at 0; make every tensor distinctive
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _saved_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# ------------------------------------------------------------- tiny GGUF writer (test side)

_GGUF_MODULES = {  # HF module → GGUF tensor stem, as llama.cpp's converter names them
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "he", "ll"]
_CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_MODULES[module]}.{kind}"


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama Q/K rows (HF halves → pairs)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _write_gguf(model: torch.nn.Module, path: Path, gguf_arch: str) -> Path:
    config = model.config
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(_TOKENS) - 3))
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(_CHAT_TEMPLATE)
    for name, tensor in _saved_tensors(model).items():
        tensor = tensor.detach().float()
        if gguf_arch == "llama" and ".q_proj." in name:
            tensor = _llama_cpp_permute(tensor, config.num_attention_heads)
        elif gguf_arch == "llama" and ".k_proj." in name:
            tensor = _llama_cpp_permute(tensor, config.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------ packaged SmolLM2 GGUF

def test_packaged_model_is_converted_into_the_cache(packaged, cache_dir):
    resolved, _ = packaged
    assert resolved.source == "packaged"
    assert resolved.name == "SmolLM2-135M-Instruct"
    assert resolved.model_dir.parent == cache_dir / "gguf"
    assert resolved.tokenizer_dir == resolved.model_dir
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in resolved.model_dir.iterdir()}
    assert not [p for p in resolved.model_dir.parent.iterdir() if ".partial-" in p.name]


def test_second_resolve_hits_the_cache_without_reading_the_gguf(packaged, monkeypatch):
    resolved, first_s = packaged

    def fail(*args, **kwargs):
        raise AssertionError("cache hit must not open or convert the GGUF file")

    monkeypatch.setattr(gguf, "GGUFReader", fail)
    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    for name in ("SmolLM2-135M-Instruct", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        started = time.perf_counter()
        again = resolve_model(name)
        elapsed = time.perf_counter() - started
        assert again.model_dir == resolved.model_dir and again.name == name
        assert elapsed < 0.1, f"cache hit took {elapsed:.3f} s (first resolve {first_s:.1f} s)"


def test_packaged_config_and_architecture(packaged):
    config = load_hf_config(packaged[0].model_dir)
    assert check_architecture(config) == "LlamaForCausalLM"
    assert config.tie_word_embeddings is True
    assert config.dtype == torch.float32
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.vocab_size) == (30, 576, 9, 3, 64, 49152)


def test_packaged_weights_match_transformers_gguf_loader(packaged, packaged_gguf):
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(packaged_gguf.parent), gguf_file=packaged_gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    ours = dict(iter_weights(packaged[0].model_dir))
    # Tied: lm_head is the embedding and is not stored separately.
    assert set(ours) == set(expected) - {"lm_head.weight"}
    assert torch.equal(expected["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == expected[name].shape, name
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    # The un-permutation is not a no-op: the stored Q rows differ from the GGUF's order.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, _llama_cpp_permute(q, 9))


def test_packaged_model_answers_a_question_greedily(packaged):
    """Our converted directory runs in transformers and gives a sensible answer."""
    resolved = packaged[0]
    tokenizer = load_tokenizer(resolved.tokenizer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(resolved.model_dir)).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_packaged_tokenizer_keeps_chat_template_and_vocabulary(packaged, packaged_gguf):
    tokenizer = load_tokenizer(packaged[0].tokenizer_dir)
    metadata = gguf.GGUFReader(packaged_gguf).fields["tokenizer.chat_template"].contents()
    assert tokenizer.chat_template == metadata
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in text
    reference = transformers.AutoTokenizer.from_pretrained(str(packaged_gguf.parent), gguf_file=packaged_gguf.name)
    sample = "Hello, world! Tessera pages its KV cache."
    assert tokenizer(sample).input_ids == reference(sample).input_ids
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152


# ------------------------------------------------------------------ tiny GGUF round trips

@pytest.mark.parametrize("arch, gguf_arch, overrides", [
    ("LlamaForCausalLM", "llama", dict(tie_word_embeddings=False)),
    ("Qwen2ForCausalLM", "qwen2", dict(tie_word_embeddings=True)),
    ("Qwen3ForCausalLM", "qwen3", dict(tie_word_embeddings=True, head_dim=32)),  # head_dim != 64 / 4
])
def test_gguf_round_trip_restores_weights_and_logits(tmp_path, monkeypatch, arch, gguf_arch, overrides):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_model(arch, **overrides)
    path = _write_gguf(model, tmp_path / f"tiny-{gguf_arch}.gguf", gguf_arch)

    resolved = resolve_model(str(path))
    assert resolved.source == "gguf" and resolved.model_dir.is_relative_to(tmp_path / "cache")

    config = load_hf_config(resolved.model_dir)
    assert check_architecture(config) == arch
    assert config.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert config.head_dim == _head_dim(model.config)
    ours = dict(iter_weights(resolved.model_dir))
    expected = _saved_tensors(model)
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(resolved.model_dir)).eval()
    ids = torch.tensor([[1, 5, 40, 7, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert load_tokenizer(resolved.tokenizer_dir).chat_template == _CHAT_TEMPLATE


def test_unpermute_rope_rows_pairs_to_halves():
    # One head of 4 rows: GGUF order (a0, b0, a1, b1) → HF order (a0, a1, b0, b1).
    gguf_rows = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    assert unpermute_rope_rows(gguf_rows, num_heads=1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
    weight = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_rope_rows(_llama_cpp_permute(weight, 3), 3), weight)
    bias = torch.randn(2 * 6)
    assert torch.equal(unpermute_rope_rows(_llama_cpp_permute(bias, 2), 2), bias)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    return _write_gguf(_tiny_model("Qwen2ForCausalLM", tie_word_embeddings=True), tmp_path / "tiny.gguf", "qwen2")


def test_interrupted_conversion_leaves_no_cache_entry(tiny_gguf, monkeypatch):
    entry = gguf_cache.cache_entry_dir(tiny_gguf)
    entry.parent.mkdir(parents=True)
    stale = entry.parent / f".{entry.name}.partial-killed"  # left by a conversion that was SIGKILLed
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing weights")

    with monkeypatch.context() as mp:
        mp.setattr(gguf_convert, "_convert_weights", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            resolve_model(str(tiny_gguf))
    assert list(entry.parent.iterdir()) == []  # neither the entry, nor our partial, nor the stale one

    resolved = resolve_model(str(tiny_gguf))
    assert resolved.model_dir == entry
    assert set(load_file(entry / "model.safetensors")) >= {"model.embed_tokens.weight", "model.norm.weight"}


def test_cache_key_follows_the_file_contents(tiny_gguf):
    before = gguf_cache.cache_entry_dir(tiny_gguf)
    assert gguf_cache.cache_entry_dir(tiny_gguf) == before
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.cache_entry_dir(tiny_gguf) != before


def test_gguf_of_unsupported_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError) as info:
        resolve_model(str(path))
    assert all(name in str(info.value) for name in SUPPORTED)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_garbage_gguf_is_a_model_load_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="broken.gguf") as info:
        resolve_model(str(path))
    assert info.value.param == "model"


# ------------------------------------------------------------ Hugging Face directories


def test_a_conversion_removes_entries_whose_gguf_file_is_gone_or_changed(tiny_gguf, tmp_path):
    """A reinstalled package (same path, new modification time) or a deleted copy leaves no stale 0.5 GB entry."""
    first = resolve_model(str(tiny_gguf)).model_dir
    copy = tmp_path / "copy" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)
    copied = resolve_model(str(copy)).model_dir
    legacy = first.parent / "tiny-0000000000000000"  # an entry written before entries recorded their source
    shutil.copytree(first, legacy)
    (legacy / "source.json").unlink()
    copy.unlink()
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # "reinstalled"
    second = resolve_model(str(tiny_gguf)).model_dir
    assert second != first and second.is_dir() and legacy.is_dir()
    assert not first.exists() and not copied.exists()
