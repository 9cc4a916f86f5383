"""LoRA adapters' cost: a workload with its requests spread over several adapters against the same workload
without LoRA, in one process, and the decode step of a batch with and without adapters.

    # W1 (Qwen2.5-7B shape, random weights) with 8 rank-16 adapters, then 64 requests decoding:
    python benchmarks/lora_throughput.py --model .gpucache/qwen2.5-7b --load-format dummy --dtype bfloat16 \\
        --workload peer-w1 --num-prompts 256 --input-len 1024 --output-len 512 --max-num-batched-tokens 16384

The adapters are PEFT checkpoints written for the model's shapes (every attention and MLP projection, random
``A`` and ``B``: the kernels' work does not depend on the values) into ``--adapter-dir``. The engine with LoRA
runs ``--max-loras`` (default: as many as adapters) in one batch, so every step mixes all of them. Goals
(issue "LoRA adapters served together"): the workload with adapters at least 80% of the one without; the
decode step at batch 64 at most 1.2x the one without. Writes JSON with the command to ``--output-json``.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
from pathlib import Path

import torch

from throughput import (add_engine_args, add_workload_args, make_workload, print_tessera, profile_steps, roofline,
                        run_tessera, write_result)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LoRARequest  # noqa: E402
from inference.lora.checkpoint import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE  # noqa: E402
from inference.model_loader import load_hf_config, resolve_model  # noqa: E402

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each LoRA target projection of a Llama-family decoder layer."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapters(hf_config, folder: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """``count`` PEFT LoRA adapters of rank ``rank`` on every projection of every layer, float16 weights."""
    from safetensors.torch import save_file
    shapes = projection_shapes(hf_config)
    paths = []
    for index in range(count):
        path = folder / f"adapter-{index}"
        path.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(seed + index)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for name in TARGET_MODULES:
                block = "self_attn" if name in _ATTENTION else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                fan_in, fan_out = shapes[name]
                tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator)
                                                      / fan_in ** 0.5).half()
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.01).half()
        save_file(tensors, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGET_MODULES), "lora_dropout": 0.0, "bias": "none"}))
        paths.append(path)
    return paths


def measure(args, prompts, outputs, loras: list[LoRARequest] | None) -> dict:
    """One engine, with LoRA (requests in turn over ``loras``) or without; its figures and roofline."""
    run_args = copy.copy(args)
    if loras:
        run_args.lora_engine_kwargs = dict(enable_lora=True, max_loras=args.max_loras or len(loras),
                                           max_lora_rank=args.lora_rank, max_cpu_loras=len(loras))
        run_args.lora_requests = loras
    ours = run_tessera(run_args, prompts, outputs)
    roof = roofline(ours, prompts, outputs, args.copy_gbps, args.matmul_tflops)
    print_tessera(ours, roof)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"tessera": ours, "roofline": roof}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    add_engine_args(parser)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=0, help="adapters in one batch (0: --num-adapters)")
    parser.add_argument("--adapter-dir", default="/tmp/tessera-bench-adapters")
    parser.add_argument("--decode-batch", type=int, default=64, help="the decode-step comparison's batch (0: skip)")
    parser.add_argument("--decode-input-len", type=int, default=128)
    parser.add_argument("--decode-output-len", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="then a kernel table of this many decode steps of --decode-batch requests with adapters")
    parser.add_argument("--profile-only", action="store_true", help="only the kernel table")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    args.peer = "none"

    hf_config = load_hf_config(resolve_model(args.model, load_format=args.load_format).model_dir)
    paths = write_adapters(hf_config, Path(args.adapter_dir), args.num_adapters, args.lora_rank, args.seed)
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    prompts, outputs = make_workload(args, hf_config.vocab_size)
    result = {"command": "python " + " ".join(sys.argv), "num_adapters": args.num_adapters,
              "lora_rank": args.lora_rank, "max_loras": args.max_loras or args.num_adapters,
              "workload": {"model": args.model, "flood": args.workload, "num_prompts": len(prompts),
                           "input_tokens": sum(map(len, prompts)), "requested_output_tokens": sum(outputs)}}
    args.profile_phase = "decode"
    if args.profile_only:
        args.decode_batch = args.decode_batch or 64
    if not args.profile_only:
        print(f"== {len(prompts)} requests without LoRA")
        result["without_lora"] = measure(args, prompts, outputs, None)
        print(f"== the same requests over {len(loras)} rank-{args.lora_rank} adapters")
        result["with_lora"] = measure(args, prompts, outputs, loras)
        result["throughput_ratio"] = (result["with_lora"]["tessera"]["output_tokens_per_s"]
                                      / result["without_lora"]["tessera"]["output_tokens_per_s"])
        print(f"with LoRA / without: {result['throughput_ratio']:.3f} of the output tok/s")
    if args.decode_batch and not args.profile_only:
        step_args = copy.copy(args)
        step_args.workload, step_args.num_prompts = "random", args.decode_batch
        step_args.input_len, step_args.output_len = args.decode_input_len, args.decode_output_len
        step_prompts, step_outputs = make_workload(step_args, hf_config.vocab_size)
        steps = {}
        for name, adapters in (("without_lora", None), ("with_lora", loras)):
            print(f"== decode steps, batch {args.decode_batch}, {name.replace('_', ' ')}")
            steps[name] = measure(step_args, step_prompts, step_outputs, adapters)["tessera"]
        # the median TPOT: one decode step of the whole batch (an engine step may run a window of several)
        result["decode_step_ms"] = {k: v["median_tpot_ms"] for k, v in steps.items()}
        result["decode_windows"] = {k: v["window_steps"] for k, v in steps.items()}
        result["decode_step_ratio"] = result["decode_step_ms"]["with_lora"] / result["decode_step_ms"]["without_lora"]
        print(f"decode step at batch {args.decode_batch}: {result['decode_step_ms']} ms, "
              f"{result['decode_step_ratio']:.3f}x with LoRA")
    if args.profile_steps:  # the kernels of decode steps with adapters
        profile_args = copy.copy(args)
        profile_args.workload, profile_args.num_prompts = "random", args.decode_batch or 64
        profile_args.input_len, profile_args.output_len = args.decode_input_len, args.decode_output_len
        profile_args.lora_engine_kwargs = dict(enable_lora=True, max_loras=args.max_loras or len(loras),
                                               max_lora_rank=args.lora_rank, max_cpu_loras=len(loras))
        profile_args.lora_requests = loras
        result["kernel_profile_with_lora"] = prof = profile_steps(profile_args, *make_workload(profile_args,
                                                                                               hf_config.vocab_size))
        for k in prof["kernels"][:20]:
            print(f"  {100 * k['share']:5.1f}% {k['device_ms']:9.1f} ms {k['calls']:6d}x {k['name'][:90]}")
        print("  device timeline:", prof["timeline"])
    write_result(result, args.output_json, "lora-throughput.json")


if __name__ == "__main__":
    main()
