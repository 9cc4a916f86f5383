"""GPU consistency checks of the engine (run on the H200, beside the throughput benchmark).

    python benchmarks/gpu_check.py --model qwen2.5-0.5b [--num-prompts 32] [--max-tokens 64]

    python benchmarks/gpu_check.py --dtype float32 --checks prefix swap   # strict: no bf16 near-ties

Checks (``--checks``, all by default), in ``--dtype`` (bfloat16 by default) unless said otherwise:
1. graphs: CUDA graphs vs eager (same Triton kernels): greedy tokens must be identical.
2. triton: Triton vs the PyTorch reference backend (always float32): greedy tokens and the largest
   logprob difference.
3. async: async scheduling vs synchronous steps (graphs, requests of different output lengths):
   greedy tokens must be identical.
4. prefix: prefix caching on vs off (prompts sharing a 512-token prefix, graphs): identical tokens.
5. swap: swap vs recompute preemption under a KV pool too small for the batch: identical tokens.
6. multistep: multi-step scheduling (``num_scheduler_steps=8``, CUDA graphs, requests of different output
   lengths, no logprobs: a request with logprobs keeps its batch on single steps) vs single steps.
In bfloat16 the cached-context and recompute paths sum in another order than a full prefill, which
can flip near-ties of random weights; in float32 a difference is a bug.
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


def run(model: str, prompts, max_tokens: int | list[int], logprobs: int | None = 0, **kwargs):
    llm = LLM(model=model, load_format="dummy", max_model_len=1024, **{"max_num_seqs": 64, **kwargs})
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in lengths]
    ahead_before = llm.llm_engine.num_steps_ahead
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(e.values())).logprob for e in o.outputs[0].logprobs or ()] for o in outs]
    free_ok = llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.kv_cache_manager.num_blocks
    run.steps_ahead = llm.llm_engine.num_steps_ahead - ahead_before
    stats = llm.llm_engine.get_stats()
    run.stats = {"prefix_cache_hits_tokens": stats.prefix_cache_hits_total, "preemptions": stats.num_preemptions_total,
                 "swapped_out": stats.num_swapped_out_total,
                 "multi_step_windows": llm.llm_engine.num_multi_step_windows}
    llm.close()
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
    first = [(lx[0], ly[0]) for lx, ly in zip(a[1], b[1]) if lx and ly]
    return {"identical_requests": same, "requests": len(a[0]), "first_divergence": first_diff,
            "max_abs_logprob_diff_common_prefix": diff,
            # how peaked the distributions are: near 0 = saturated logits (a check that says little)
            "mean_first_token_logprob": [sum(x for x, _ in first) / max(1, len(first)),
                                         sum(y for _, y in first) / max(1, len(first))]}


CHECKS = ("graphs", "triton", "async", "prefix", "swap", "multistep")


def show(name: str, summary: dict) -> None:
    print(f"{name}:", {k: v for k, v in summary.items() if k != "first_divergence"}, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of every check but Triton vs torch (always float32)")
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 50000) for _ in range(rng.randint(8, 300))] for _ in range(args.num_prompts)]
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    dt, short = args.dtype, {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]
    if "graphs" in args.checks:
        eager = run(args.model, prompts, args.max_tokens, dtype=dt, enforce_eager=True)
        graphs = run(args.model, prompts, args.max_tokens, dtype=dt, enforce_eager=False)
        result[f"graphs_vs_eager_{short}"] = compare(graphs, eager) | {
            "eager_s": eager[2], "graphs_s": graphs[2], "blocks_returned": eager[3] and graphs[3]}
        show("CUDA graphs vs eager", result[f"graphs_vs_eager_{short}"])
    if "triton" in args.checks:
        ref = run(args.model, prompts[:8], 16, dtype="float32", attention_backend="torch", enforce_eager=True)
        tri = run(args.model, prompts[:8], 16, dtype="float32", attention_backend="triton", enforce_eager=False)
        result["triton_vs_torch_fp32"] = compare(tri, ref)
        show("Triton vs torch (fp32)", result["triton_vs_torch_fp32"])
    lengths = [rng.randint(8, args.max_tokens) for _ in prompts]
    if "async" in args.checks:
        sync = run(args.model, prompts, lengths, dtype=dt, async_scheduling=False)
        ahead = run(args.model, prompts, lengths, dtype=dt, async_scheduling=True)
        result[f"async_vs_sync_{short}"] = compare(ahead, sync) | {"steps_launched_ahead": run.steps_ahead,
                                                                   "blocks_returned": sync[3] and ahead[3]}
        show("async vs sync scheduling", result[f"async_vs_sync_{short}"])
    if "prefix" in args.checks:
        shared = [rng.randrange(100, 50000) for _ in range(512)]
        prefixed = [shared + p[:64] for p in prompts]
        off = run(args.model, prefixed, lengths, dtype=dt, enable_prefix_caching=False)
        on = run(args.model, prefixed, lengths, dtype=dt, enable_prefix_caching=True)
        result[f"prefix_caching_on_vs_off_{short}"] = compare(on, off) | run.stats | {
            "blocks_returned": off[3] and on[3]}
        show("prefix caching on vs off", result[f"prefix_caching_on_vs_off_{short}"])
    if "swap" in args.checks:
        small = dict(dtype=dt, num_kv_blocks=160, max_num_seqs=32)  # 32 prompts of up to 364 tokens do not fit
        recompute = run(args.model, prompts, lengths, preemption_mode="recompute", **small)
        recompute_stats = run.stats
        swap = run(args.model, prompts, lengths, preemption_mode="swap", swap_space=1.0, **small)
        result[f"swap_vs_recompute_{short}"] = compare(swap, recompute) | {
            "recompute": recompute_stats, "swap": run.stats, "blocks_returned": swap[3] and recompute[3]}
        show("swap vs recompute preemption", result[f"swap_vs_recompute_{short}"])
    if "multistep" in args.checks:
        single = run(args.model, prompts, lengths, logprobs=None, dtype=dt, num_scheduler_steps=1)
        multi = run(args.model, prompts, lengths, logprobs=None, dtype=dt, num_scheduler_steps=8)
        result[f"multistep_8_vs_1_{short}"] = compare(multi, single) | {
            "multi_step_windows": run.stats["multi_step_windows"], "blocks_returned": single[3] and multi[3]}
        show("multi-step (8) vs single steps", result[f"multistep_8_vs_1_{short}"])
    out = Path(args.output_json) if args.output_json else Path(__file__).resolve().parent / "results" / "gpu_check.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
