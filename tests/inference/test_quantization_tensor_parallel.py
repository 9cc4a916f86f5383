"""Quantized models under tensor parallelism on CPU (gloo).

* Weight level, every method (FP8 included, which has no CPU engine path): each rank of a
  TP=2 model holds exactly its slice of the TP=1 model's quantized weights, for random (dummy)
  weights as the GPU benchmark loads them, and its row-parallel layers sum to the TP=1 output.
* Engine level: AWQ and GPTQ act-order checkpoints of tiny random Qwen2 models written by
  ``quantize_model`` give the same greedy tokens with TP=2 (and GPTQ act-order with TP=3) as with
  TP=1; a group size the ranks cannot split fails at start-up. (SmolLM2's groups of 64 allow TP=3,
  but quantizing it takes about 15 minutes on a busy CI machine.)
"""
from __future__ import annotations

import threading

import pytest
import torch

from inference import LLM, InvalidRequestError, SamplingParams
from inference.distributed.partition import LinearPartition, valid_quantized_tensor_parallel_sizes
from inference.distributed.process_group import TensorParallelGroup, join_group, open_store
from inference.model_loader import load_hf_config
from inference.models import build_model
from inference.quantization import QuantizationConfig, QuantizedLinear
from inference.quantization.fp8 import Fp8LinearMethod
from inference.quantization.linear import make_linear_method
from inference.quantization.quantize import CalibrationConfig, quantize_model

from .conftest import make_tiny_model

NUM_TOKENS = 24
TINY_ARGS = dict(max_model_len=256, max_num_batched_tokens=32, kv_cache_space=0.05)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Qwen2: hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, untied head."""
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tpq") / "qwen2", smollm2_tokenizer)


def _on_two_ranks(fn):
    """Run ``fn(tp_group)`` on two ranks (threads of this process, a real gloo group); their results."""
    store = open_store(2)
    results, errors = [None, None], []

    def rank(r: int) -> None:
        try:
            group = join_group(r, 2, "cpu", store=store if r == 0 else None, port=store.port)
            results[r] = fn(group)
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def _dense(layer: QuantizedLinear) -> torch.Tensor:
    """The layer's weights as ``[out_features, in_features]`` float32, input features in checkpoint order."""
    if isinstance(layer.method, Fp8LinearMethod):
        return layer.weight.float() * layer.weight_scale[:, None]
    w = layer.method.dequantized_weight(layer, torch.float32)
    if layer.perm is not None:
        w = torch.empty_like(w).index_copy_(0, layer.perm, w)
    return w.t()


def _quantized_layers(model) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


QUANT = {"awq": QuantizationConfig("awq", group_size=32, from_checkpoint=False),
         "gptq": QuantizationConfig("gptq", group_size=32, zero_point=False, from_checkpoint=False),
         "gptq_per_channel": QuantizationConfig("gptq", group_size=-1, zero_point=False, from_checkpoint=False),
         "fp8": QuantizationConfig("fp8", bits=8, group_size=-1, zero_point=False, from_checkpoint=False)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(QUANT))
def test_each_rank_holds_its_slice_of_the_single_rank_quantized_weights(tiny_qwen2, kind):
    """Dummy weights, as ``benchmarks/tensor_parallel.py`` loads the Qwen2.5-7B shape on GPUs."""
    hf_config = load_hf_config(tiny_qwen2)
    build = dict(hf_config=hf_config, dtype=torch.float32, device="cpu", max_position=256, quant_config=QUANT[kind])
    full = _quantized_layers(build_model(**build))
    x_attn, x_mlp = torch.randn(3, 64), torch.randn(3, 128)

    def rank(tp):
        model = build_model(**build, tp=tp)
        layers = _quantized_layers(model)
        mlp = model.model.layers[0].mlp.down_proj
        attn = model.model.layers[0].self_attn.o_proj
        with torch.no_grad():
            outputs = (attn(x_attn[:, slice(*attn.partition.in_range)]),
                       mlp(x_mlp[:, slice(*mlp.partition.in_range)]))
        return {name: (_dense(layer), layer.partition) for name, layer in layers.items()}, outputs

    for parts, outputs in _on_two_ranks(rank):
        assert parts.keys() == full.keys()
        for name, (dense, partition) in parts.items():
            rows = torch.cat([torch.arange(lo, hi) for lo, hi in partition.out_ranges])
            expected = _dense(full[name])[rows][:, slice(*partition.in_range)]
            assert torch.equal(dense, expected), name
        with torch.no_grad():
            attn_out, mlp_out = outputs
            # Row-parallel: the all-reduced partial products are the single-rank layer's output
            # (FP8 up to each rank's own activation scales).
            tol = dict(atol=2e-2, rtol=2e-2) if kind == "fp8" else dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(attn_out, full["model.layers.0.self_attn.o_proj"](x_attn), **tol)
            torch.testing.assert_close(mlp_out, full["model.layers.0.mlp.down_proj"](x_mlp), **tol)


def test_a_checkpoint_tensor_of_the_wrong_full_shape_is_named():
    """Rank 1 of 2 of a row-parallel GPTQ layer (64 -> 32 features) is handed a 48-row tensor."""
    partition = LinearPartition(64, 32, (32, 64), ((0, 32),), {}, True, TensorParallelGroup(1, 2), {})
    config = QuantizationConfig("gptq", group_size=32, zero_point=False)
    layer = QuantizedLinear(32, 32, False, make_linear_method(config), torch.float32, partition=partition)
    with pytest.raises(ValueError, match=r"qweight: expected 8 elements along dim 0 \(64 input features\), "
                                         r"got shape \(6, 32\)"):
        layer.load_weight("qweight", torch.zeros(6, 32, dtype=torch.int32))
    layer.load_weight("qweight", torch.arange(8 * 32, dtype=torch.int32).view(8, 32))
    assert layer.qweight[0, 0] == 4 * 32  # rank 1 holds packed rows 4..7 (input features 32..63)


@pytest.mark.parametrize("kind", ["awq", "fp8"])
def test_a_row_parallel_layer_with_a_bias_adds_it_once(kind):
    """``apply`` adds the bias itself (a kernel may fuse it), but a row-parallel rank must not: its
    partial products are summed over the ranks, the bias added once after that."""
    def layer(partition=None):
        quantized = QuantizedLinear(64 if partition is None else 32, 32, True, make_linear_method(QUANT[kind]),
                                    torch.float32, partition=partition)
        quantized.init_dummy(torch.Generator().manual_seed(0))  # the full layer's draw, on every rank
        with torch.no_grad():
            quantized.bias.fill_(1.0)  # well above FP8's error
        quantized.method.process_weights_after_loading(quantized)
        return quantized

    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = layer()(x)

    def rank(tp):
        start = 32 * tp.rank
        with torch.no_grad():
            return layer(LinearPartition(64, 32, (start, start + 32), ((0, 32),), {}, True, tp, {}))(
                x[:, start:start + 32])

    tol = dict(atol=2e-2, rtol=2e-2) if kind == "fp8" else dict(atol=1e-5, rtol=1e-5)
    for out in _on_two_ranks(rank):
        torch.testing.assert_close(out, expected, **tol)


# ---- engine: greedy tokens of quantized checkpoints, TP=2 against TP=1 ------------------------------
CHECKPOINTS = {"awq": dict(method="awq", group_size=32),
               "gptq_act_order": dict(method="gptq", group_size=32, desc_act=True)}


@pytest.fixture(scope="module")
def quantized_tiny(tiny_qwen2, tmp_path_factory):
    """kind -> a checkpoint of the tiny Qwen2 written by ``quantize_model`` (what ``manage.py quantize`` runs)."""
    calibration = CalibrationConfig(num_samples=2, seq_len=64, awq_grid=4)
    return {kind: quantize_model(str(tiny_qwen2), tmp_path_factory.mktemp(kind), calibration=calibration, **kwargs)
            for kind, kwargs in CHECKPOINTS.items()}


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                          use_tqdm=False)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_quantized_checkpoint_tp2_same_greedy_tokens(quantized_tiny, kind):
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    model = str(quantized_tiny[kind])
    one = LLM(model=model, **TINY_ARGS)
    assert one.llm_engine.config.quant_config.method == CHECKPOINTS[kind]["method"]
    expected = _greedy(one, prompts)
    one.close()
    with LLM(model=model, tensor_parallel_size=2, **TINY_ARGS) as two:
        if kind == "gptq_act_order":  # the rank's rows point at groups all over the full o_proj
            o_proj = two.llm_engine.runner.model.model.layers[0].self_attn.o_proj
            assert o_proj.row_groups is not None and int(o_proj.row_groups.max()) >= 1
        assert _greedy(two, prompts) == expected


def test_group_size_the_ranks_cannot_split_fails_at_start_up(quantized_tiny, tiny_qwen2, tmp_path):
    # Groups of 64 over o_proj's 64 input features: two ranks would hold half a group each.
    folder = quantize_model(str(tiny_qwen2), tmp_path / "g64", method="gptq", group_size=64,
                            calibration=CalibrationConfig(num_samples=1, seq_len=32))
    with pytest.raises(InvalidRequestError) as info:
        LLM(model=str(folder), tensor_parallel_size=2, **TINY_ARGS)
    assert info.value.param == "tensor_parallel_size"
    assert str(info.value) == ("tensor_parallel_size=2 splits o_proj's 64 input features into parts of 32 (rank 0: "
                               "[0, 32)), not on multiples of the group size 64 (each rank must hold whole "
                               "quantization groups); valid sizes with GPTQ group size 64: 1.")


def test_valid_sizes_of_smollm2_with_quantization_groups(smollm2_dir):
    """SmolLM2: 9 heads of 64 (o_proj reads 576 features), intermediate 1536."""
    config = load_hf_config(smollm2_dir)
    assert valid_quantized_tensor_parallel_sizes(config, "gptq", 64) == [1, 3]   # 9 ranks: 1536 / 9
    assert valid_quantized_tensor_parallel_sizes(config, "awq", 128) == [1]      # 576 / 3 = 192
    assert valid_quantized_tensor_parallel_sizes(config, "fp8", -1) == [1, 3, 9]


@pytest.mark.timeout(600)
def test_gptq_act_order_tp3_same_greedy_tokens(tmp_path, smollm2_tokenizer):
    """Three ranks: a tiny Qwen2 of 6 heads of 16 (3 KV heads) and intermediate 192, groups of 32:
    each rank holds 32 of o_proj's 96 input rows and 64 of down_proj's 192."""
    model = make_tiny_model("qwen2", tmp_path / "qwen2", smollm2_tokenizer, hidden_size=96, intermediate_size=192,
                            num_attention_heads=6, num_key_value_heads=3)
    folder = str(quantize_model(str(model), tmp_path / "gptq", method="gptq", group_size=32, desc_act=True,
                                calibration=CalibrationConfig(num_samples=2, seq_len=64)))
    prompts = [[101, 2045, 3050], list(range(500, 540)), [7, 8000, 9, 31000, 12]]
    one = LLM(model=folder, **TINY_ARGS)
    expected = _greedy(one, prompts)
    one.close()
    with LLM(model=folder, tensor_parallel_size=3, **TINY_ARGS) as three:
        assert _greedy(three, prompts) == expected
