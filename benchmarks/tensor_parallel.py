"""Tensor parallelism on GPUs: TP=1 against TP=2 (or --tp-sizes), same greedy tokens and W1
throughput side by side, in one run.

    python benchmarks/tensor_parallel.py                  # Qwen2.5-7B shape, dummy weights, 2 GPUs
    python benchmarks/tensor_parallel.py --num-prompts 64 --output-len 128   # a shorter W1
    python benchmarks/tensor_parallel.py --quantization fp8    # FP8 W8A8 (quantized at load), TP=1 vs TP=2
    python benchmarks/tensor_parallel.py --quantization awq    # random 4-bit weights, groups of 128

For each size, in a fresh subprocess each (so that one engine's GPU memory never limits the next):
1. greedy check: ``--check-prompts`` random prompts, ``--check-tokens`` greedy tokens in
   ``--check-dtype`` (float32 by default: the all-reduce sums in another order than one GPU's
   matmul, which in bfloat16 can flip near-ties of random weights; in float32 a flip is a bug);
   the tokens of every size are compared with TP=1's (identical requests, first divergence,
   largest logprob difference over the common prefix, from ``gpu_check.compare``);
   With ``--quantization fp8`` the matmuls round their outputs to bfloat16 (``torch._scaled_mm``
   with row-wise scales) and each rank scales its own activations, so near-ties can flip: read the
   logprob difference beside the count of identical requests;
2. throughput: W1 of ``benchmarks/throughput.py`` (256 x 1024 in / 512 out, bfloat16, same
   prompts for every size), with its figures (TTFT, TPOT, device wait).
Writes JSON with the exact command to benchmarks/results/tensor_parallel_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def check_tokens(args) -> dict:
    """Greedy tokens (and their logprobs) of the check prompts at ``args.tp``."""
    from gpu_check import run
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 50000) for _ in range(rng.randint(8, 300))] for _ in range(args.check_prompts)]
    tokens, logprobs, elapsed, free_ok = run(args.model, prompts, args.check_tokens, dtype=args.check_dtype,
                                             tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager,
                                             quantization=args.quantization)
    return {"tokens": tokens, "logprobs": logprobs, "seconds": elapsed, "blocks_all_free": free_ok}


def throughput(args) -> dict:
    """W1 through ``throughput.run_tessera`` at ``args.tp``."""
    import throughput as tp_bench
    from inference.model_loader import load_hf_config, resolve_model
    vocab = load_hf_config(resolve_model(args.model, load_format="dummy").model_dir).vocab_size
    w1 = argparse.Namespace(workload="peer-w1", input_len=args.input_len, output_len=args.output_len,
                            num_prompts=args.num_prompts, seed=0, model=args.model, dtype=args.dtype,
                            load_format="dummy", max_model_len=args.input_len + args.output_len,
                            max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
                            kv_cache_space=4.0, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp,
                            quantization=args.quantization)
    prompts, outputs = tp_bench.make_workload(w1, vocab)
    result = tp_bench.run_tessera(w1, prompts, outputs)
    result.pop("hf_config")
    return result


def child(args) -> None:
    result = check_tokens(args) if args.role == "check" else throughput(args)
    Path(args.child_output).write_text(json.dumps(result))
    # Leave without running NCCL's destructors: their teardown never returned on two H200s
    # (see inference/distributed/process_group.py, TensorParallelGroup.shutdown).
    sys.stdout.flush()
    os._exit(0)


def run_child(argv: list[str], role: str, tp: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, *argv, "--role", role, "--tp", str(tp), "--child-output", out.name]
        print(f"[tp={tp}] {role} ... ({time.strftime('%H:%M:%S')})", flush=True)
        subprocess.run(cmd, check=True)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--tp-sizes", default="1,2", help="comma-separated; the first is the reference")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the throughput run")
    parser.add_argument("--check-dtype", default="float32")
    parser.add_argument("--check-prompts", type=int, default=16)
    parser.add_argument("--check-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true", help="the greedy check only")
    parser.add_argument("--quantization", choices=["awq", "gptq", "fp8"], default=None,
                        help="quantize the dummy weights (awq/gptq: random 4-bit codes, groups of 128; fp8: at load)")
    parser.add_argument("--unquantized-reference", action="store_true",
                        help="with --quantization fp8: also compare every TP size with an unquantized TP=1 run "
                             "on the same dummy weights (tells FP8's own noise from the tensor-parallel split)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--role", choices=["check", "throughput"], help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.unquantized_reference and args.quantization != "fp8":
        parser.error("--unquantized-reference needs --quantization fp8 (awq/gptq dummy weights are other random codes)")
    if args.role:
        child(args)
        return

    from gpu_check import compare
    from throughput import write_result
    argv = sys.argv[1:]  # the children ignore --output-json
    sizes = [int(s) for s in args.tp_sizes.split(",")]
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": args.model, "quantization": args.quantization, "tp_sizes": sizes, "check": {},
              "throughput": {}}
    checks = {tp: run_child(argv, "check", tp) for tp in sizes}
    if args.quantization and args.unquantized_reference:
        plain = [a for a in argv if a not in (args.quantization, "--quantization", "--unquantized-reference")]
        unquantized = run_child(plain, "check", 1)
        result["check_vs_unquantized_tp1"] = {
            f"tp{tp}": compare((unquantized["tokens"], unquantized["logprobs"]), (c["tokens"], c["logprobs"]))
            for tp, c in checks.items()}
        for name, summary in result["check_vs_unquantized_tp1"].items():
            print(f"[{name} {args.quantization}] vs unquantized tp=1: {summary['identical_requests']}/"
                  f"{summary['requests']} identical, first divergences {summary['first_divergence']}")
    reference = checks[sizes[0]]
    for tp in sizes:
        summary = compare((reference["tokens"], reference["logprobs"]), (checks[tp]["tokens"], checks[tp]["logprobs"]))
        summary.update(seconds=checks[tp]["seconds"], blocks_all_free=checks[tp]["blocks_all_free"])
        result["check"][f"tp{tp}"] = summary
        print(f"[tp={tp}] greedy check ({args.check_dtype}): {summary['identical_requests']}/{summary['requests']} "
              f"requests identical to tp={sizes[0]}, max |logprob diff| {summary['max_abs_logprob_diff_common_prefix']:.2e}, "
              f"mean first-token logprob {summary['mean_first_token_logprob'][1]:.3f}")
    for tp in [] if args.skip_throughput else sizes:
        result["throughput"][f"tp{tp}"] = ours = run_child(argv, "throughput", tp)
        print(f"[tp={tp}] W1 {args.dtype}: {ours['output_tokens_per_s']:.1f} output tok/s ({ours['seconds']:.1f} s), "
              f"median TPOT {ours['median_tpot_ms']:.2f} ms, median TTFT {ours['median_ttft_s']:.2f} s")
    if result["throughput"]:
        base = result["throughput"][f"tp{sizes[0]}"]["output_tokens_per_s"]
        result["speedup_vs_first"] = {k: v["output_tokens_per_s"] / base for k, v in result["throughput"].items()}
    suffix = f"_{args.quantization}" if args.quantization else ""
    write_result(result, args.output_json, f"tensor_parallel_{args.model.replace('/', '_')}{suffix}.json")


if __name__ == "__main__":
    main()
