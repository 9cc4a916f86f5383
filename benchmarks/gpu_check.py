"""GPU consistency checks of the engine (run on the H200, beside the throughput benchmark).

    python benchmarks/gpu_check.py --model qwen2.5-0.5b [--num-prompts 32] [--max-tokens 64]

1. CUDA graphs vs eager (same Triton kernels, bf16): greedy tokens must be identical.
2. Triton vs the PyTorch reference backend (float32): greedy tokens and the largest logprob difference.
3. Async scheduling vs synchronous steps (bf16, graphs, requests of different output lengths):
   greedy tokens must be identical.
4. Prefix caching on vs off (prompts sharing a 512-token prefix, bf16, graphs): identical tokens.
5. Swap vs recompute preemption under a KV pool too small for the batch (bf16): identical tokens.
Writes JSON with the command to benchmarks/results/gpu_check.json (or --output-json).
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402


def run(model: str, prompts, max_tokens: int | list[int], **kwargs):
    llm = LLM(model=model, load_format="dummy", max_model_len=1024, **{"max_num_seqs": 64, **kwargs})
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths]
    ahead_before = llm.llm_engine.num_steps_ahead
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(e.values())).logprob for e in o.outputs[0].logprobs] for o in outs]
    free_ok = llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks
    run.steps_ahead = llm.llm_engine.num_steps_ahead - ahead_before
    stats = llm.llm_engine.get_stats()
    run.stats = {"prefix_cache_hits_tokens": stats.prefix_cache_hits_total, "preemptions": stats.num_preemptions_total,
                 "swapped_out": stats.num_swapped_out_total}
    del llm
    torch.cuda.empty_cache()
    return tokens, logprobs, elapsed, free_ok


def compare(a, b) -> dict:
    same = sum(x == y for x, y in zip(a[0], b[0]))
    first_diff = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None) for x, y in zip(a[0], b[0])]
    # logprob difference over the common prefix of each pair
    diff = 0.0
    for (lx, ly, fd) in zip(a[1], b[1], first_diff):
        end = len(lx) if fd is None else fd + 1
        diff = max(diff, max((abs(p - q) for p, q in zip(lx[:end], ly[:end])), default=0.0))
    return {"identical_requests": same, "requests": len(a[0]), "first_divergence": first_diff,
            "max_abs_logprob_diff_common_prefix": diff}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 50000) for _ in range(rng.randint(8, 300))] for _ in range(args.num_prompts)]
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    eager = run(args.model, prompts, args.max_tokens, dtype="bfloat16", enforce_eager=True)
    graphs = run(args.model, prompts, args.max_tokens, dtype="bfloat16", enforce_eager=False)
    result["graphs_vs_eager_bf16"] = compare(graphs, eager) | {"eager_s": eager[2], "graphs_s": graphs[2],
                                                                "blocks_returned": eager[3] and graphs[3]}
    print("CUDA graphs vs eager:", {k: v for k, v in result["graphs_vs_eager_bf16"].items() if k != "first_divergence"})
    ref = run(args.model, prompts[:8], 16, dtype="float32", attention_backend="torch", enforce_eager=True)
    tri = run(args.model, prompts[:8], 16, dtype="float32", attention_backend="triton", enforce_eager=False)
    result["triton_vs_torch_fp32"] = compare(tri, ref)
    print("Triton vs torch (fp32):", result["triton_vs_torch_fp32"])
    lengths = [rng.randint(8, args.max_tokens) for _ in prompts]
    sync = run(args.model, prompts, lengths, dtype="bfloat16", async_scheduling=False)
    ahead = run(args.model, prompts, lengths, dtype="bfloat16", async_scheduling=True)
    result["async_vs_sync_bf16"] = compare(ahead, sync) | {"steps_launched_ahead": run.steps_ahead,
                                                            "blocks_returned": sync[3] and ahead[3]}
    print("async vs sync scheduling:", {k: v for k, v in result["async_vs_sync_bf16"].items()
                                        if k != "first_divergence"})
    shared = [rng.randrange(100, 50000) for _ in range(512)]
    prefixed = [shared + p[:64] for p in prompts]
    off = run(args.model, prefixed, lengths, dtype="bfloat16", enable_prefix_caching=False)
    on = run(args.model, prefixed, lengths, dtype="bfloat16", enable_prefix_caching=True)
    result["prefix_caching_on_vs_off_bf16"] = compare(on, off) | run.stats | {"blocks_returned": off[3] and on[3]}
    print("prefix caching on vs off:", {k: v for k, v in result["prefix_caching_on_vs_off_bf16"].items()
                                        if k != "first_divergence"})
    small = dict(dtype="bfloat16", num_kv_blocks=160, max_num_seqs=32)  # 32 prompts of up to 364 tokens do not fit
    recompute = run(args.model, prompts, lengths, preemption_mode="recompute", **small)
    recompute_stats = run.stats
    swap = run(args.model, prompts, lengths, preemption_mode="swap", swap_space=1.0, **small)
    result["swap_vs_recompute_bf16"] = compare(swap, recompute) | {"recompute": recompute_stats, "swap": run.stats,
                                                                    "blocks_returned": swap[3] and recompute[3]}
    print("swap vs recompute preemption:", {k: v for k, v in result["swap_vs_recompute_bf16"].items()
                                            if k != "first_divergence"})
    out = Path(args.output_json) if args.output_json else Path(__file__).resolve().parent / "results" / "gpu_check.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
