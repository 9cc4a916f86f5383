"""Tests for the weightless benchmark shapes (``qwen2.5-7b`` etc.) and their converted tokenizer.

The tokenizer converted from Qwen's tiktoken file is checked against a small rank-based
BPE written here from the definition (split with Qwen2's regex, then repeatedly join the
adjacent pair whose concatenation has the lowest rank), and one real engine runs the
0.5B shape on CPU with random weights.
"""
from __future__ import annotations

import base64
import unicodedata

import pytest
import regex

from inference import LLM, SamplingParams
from inference.engine import EngineArgs
from inference.errors import ModelLoadError
from inference.model_loader import check_architecture, is_dummy_only, load_hf_config, load_tokenizer, resolve_model
from inference.model_loader.tiktoken_convert import QWEN2_PRETOKENIZE_REGEX, find_qwen_tiktoken

NAMES = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3-8b"]
ALIASES = [("Qwen/Qwen2.5-7B", "qwen2.5-7b"), ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
           ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"), ("QWEN2.5-0.5B", "qwen2.5-0.5b"), ("Llama-3-8B", "llama-3-8b")]
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see, won't we?\n",
    "chinese": "请用中文介绍一下长城。长城是中国古代的军事防御工程，全长两万多公里！",
    "code": 'def fibonacci(n: int) -> int:\n    """Return the n-th number."""\n\tif n < 2:\n\t\treturn n\n'
            "    return fibonacci(n - 1) + fibonacci(n - 2)  # O(2**n)\r\n\n\n   x = {'a': [1, 2.5e-3]}\n",
    "emoji": "Deploy done 🚀🎉 — ça marche! 👩‍💻 naïve café 日本語テキスト Ωμέγα  \u00a0 end  ",
}


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """A module-wide TESSERA_CACHE_DIR, so the tokenizer is converted once here."""
    path = tmp_path_factory.mktemp("tessera_dummy_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def resolved(cache_dir):
    return {name: resolve_model(name) for name in NAMES}


@pytest.fixture(scope="module")
def tokenizer(resolved):
    return load_tokenizer(resolved["qwen2.5-7b"].tokenizer_dir)


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    lines = find_qwen_tiktoken().read_bytes().splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines if line)}


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm, written out: NFC, regex split, then lowest-rank-first merges per piece."""
    ids = []
    for piece in regex.findall(QWEN2_PRETOKENIZE_REGEX, unicodedata.normalize("NFC", text)):
        data = piece.encode("utf-8")
        if data in ranks:
            ids.append(ranks[data])
            continue
        parts = [data[i:i + 1] for i in range(len(data))]
        while True:
            pairs = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            pairs = [(rank, i) for rank, i in pairs if rank is not None]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[part] for part in parts)
    return ids


# --------------------------------------------------------------------------- resolving

@pytest.mark.parametrize("name", NAMES)
def test_each_name_resolves_to_a_directory_with_config_and_tokenizer_but_no_weights(resolved, name):
    entry = resolved[name]
    assert entry.source == "dummy" and entry.name == name
    assert entry.tokenizer_dir == entry.model_dir
    files = {p.name for p in entry.model_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not [f for f in files if f.endswith((".safetensors", ".bin", ".gguf", ".pt"))]
    assert entry.model_dir.parent.parent.name.startswith("tessera_dummy_cache")
    assert not [p for p in entry.model_dir.parent.iterdir() if ".partial-" in p.name]
    assert resolve_model(name).model_dir == entry.model_dir  # a cache hit: same entry


@pytest.mark.parametrize("alias,name", ALIASES)
def test_aliases_and_any_case_resolve_to_the_same_entry(resolved, alias, name):
    entry = resolve_model(alias)
    assert entry.model_dir == resolved[name].model_dir
    assert entry.name == alias and entry.source == "dummy"


def test_qwen2_5_7b_config_is_the_published_one(resolved):
    config = load_hf_config(resolved["qwen2.5-7b"].model_dir)
    assert check_architecture(config) == "Qwen2ForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (3584, 18944, 28)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (28, 4, 152064)
    assert config.max_position_embeddings == 131072 and config.rms_norm_eps == 1e-6
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rope_parameters["rope_type"] == "default"
    assert config.tie_word_embeddings is False
    assert str(config.dtype) == "torch.bfloat16"
    assert (config.bos_token_id, config.eos_token_id) == (151643, 151643)


def test_llama_3_8b_config_is_the_published_one(resolved):
    config = load_hf_config(resolved["llama-3-8b"].model_dir)
    assert check_architecture(config) == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (4096, 14336, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (32, 8, 128256)
    assert config.max_position_embeddings == 8192 and config.rms_norm_eps == 1e-5
    assert config.rope_parameters == {"rope_theta": 500000.0, "rope_type": "default"}  # no llama3 scaling in 3.0
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id) == (128000, 128001)


@pytest.mark.parametrize("name,hidden,layers,heads,kv_heads,intermediate", [
    ("qwen2.5-0.5b", 896, 24, 14, 2, 4864), ("qwen2.5-1.5b", 1536, 28, 12, 2, 8960)])
def test_small_qwen_configs_tie_embeddings(resolved, name, hidden, layers, heads, kv_heads, intermediate):
    config = load_hf_config(resolved[name].model_dir)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (hidden, layers, heads)
    assert (config.num_key_value_heads, config.intermediate_size) == (kv_heads, intermediate)
    assert config.vocab_size == 151936 and config.tie_word_embeddings is True


# --------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("kind", TEXTS)
def test_tokenizer_round_trips_text(tokenizer, kind):
    text = TEXTS[kind]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < 151643  # ordinary text never yields an added token


def test_tokenizer_matches_rank_based_bpe(tokenizer, ranks):
    paragraphs = list(TEXTS.values()) + [
        "Transformers process tokens in parallel; attention weighs every pair. "
        "In 2017, Vaswani et al. published \"Attention Is All You Need\" (NeurIPS), and by 2024 "
        "models with 100B+ parameters were common.\n\n  - item one\n  - item two\t\t(tabs)\n",
        "SELECT name, COUNT(*) FROM users WHERE email LIKE '%@example.com' GROUP BY name;;;\n"
        "<div class=\"x\">&nbsp;</div> https://example.org/a?b=c&d=e#frag ~~~ !!! ??? ...",
        "混合 mixed テキスト with numbers 1234567890 and ١٢٣ and ⅓, plus CJK：「引号」、逗号。",
    ]
    for text in paragraphs:
        assert tokenizer.encode(text, add_special_tokens=False) == reference_encode(text, ranks), text
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [9707, 1879]  # Qwen2's known ids


def test_special_tokens_and_chat_template(tokenizer):
    assert len(tokenizer) == 151665
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tokenizer.eos_token_id == 151643 and tokenizer.bos_token_id is None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 151644 and ids.count(151645) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi\nassistant\n"


# --------------------------------------------------------------------------- engine

def test_dummy_only_name_without_load_format_dummy_fails_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="load_format='dummy'") as info:
        LLM(model="qwen2.5-7b")
    assert info.value.param == "load_format"
    assert "no weights" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing was converted or written


def test_a_local_directory_of_that_name_wins_over_the_dummy_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_dummy_only("qwen2.5-7b")
    (tmp_path / "qwen2.5-7b").mkdir()
    assert not is_dummy_only("qwen2.5-7b")


def test_local_directory_without_weights_needs_load_format_dummy(resolved, tmp_path):
    folder = tmp_path / "weightless"
    folder.mkdir()
    for file in resolved["qwen2.5-0.5b"].model_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    with pytest.raises(ModelLoadError, match="weights") as info:
        EngineArgs(model=str(folder)).create_engine_config()
    assert info.value.param == "model"
    config = EngineArgs(model=str(folder), load_format="dummy", max_model_len=64).create_engine_config()
    assert config.model_dir == str(folder) and config.load_format == "dummy"
    assert resolve_model(str(folder), load_format="dummy").source == "hf_dir"


@pytest.mark.timeout(900)
def test_engine_generates_from_the_0_5b_shape_with_random_weights(resolved):
    llm = LLM(model="qwen2.5-0.5b", load_format="dummy", max_model_len=64, kv_cache_space=0.2, max_num_seqs=2,
              device="cpu")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[9707, 1879, 0, 220, 108386], [151644, 872, 198, 13048, 151645, 198]]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    assert all(0 <= t < 151936 for o in outputs for t in o.outputs[0].token_ids)
    assert llm.llm_engine.config.model_dir == str(resolved["qwen2.5-0.5b"].model_dir)
    assert llm.llm_engine.runner.num_layers == 24
