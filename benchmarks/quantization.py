"""Quantized against bf16 weights, in one run on one GPU: kernel microbenchmarks of one linear layer of
each shape (``quant_kernels``), per-step decode latency at batch 1, 8, 32 on the Qwen2.5-7B shape
(random weights: bf16, random packed int4 + scales for AWQ/GPTQ, bf16 quantized at load for FP8), and W1
offline throughput of FP8 against bf16 (``benchmarks/throughput.py``'s machinery).

    python benchmarks/quantization.py --model .gpucache/qwen2.5-7b       # H200: everything
    python benchmarks/quantization.py --model .gpucache/qwen2.5-7b --skip-decode --skip-throughput --sweep
    python benchmarks/quantization.py --model qwen2.5-0.5b --batch-sizes 1 --decode-steps 2 --skip-throughput
                                                                       # CPU smoke run (no kernels)

Decode latency: ``batch`` requests with ``--prompt-len``-token prompts are admitted; once every request
has its first token (all later steps are pure decode, replayed from CUDA graphs unless --enforce-eager),
the time of at least ``--decode-steps`` more tokens per request is divided by the decode steps the device ran
in it: a decode step's time per token, whatever decode windows (several steps per ``engine.step()``, on by
default) the engine chose; the windows' lengths are recorded per batch size. Weight memory (GiB, and the ratio
to bf16) comes from each engine's start-up. Writes JSON with the exact command to benchmarks/results/ after each phase
(kernels, decode, W1), so a run cut short keeps what it measured, and prints a summary at the end.
Kernel microbenchmarks need CUDA and are skipped on CPU.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402
from inference.quantization import weight_memory  # noqa: E402
from inference.sched.decode_windows import AUTO_MAX_WINDOW  # noqa: E402

from quant_kernels import model_config, run_microbenchmarks  # noqa: E402
from throughput import RESULTS, make_workload, run_tessera  # noqa: E402


def _quantization(method: str) -> str | None:
    return None if method == "bf16" else method.removesuffix("-gemv")


@contextlib.contextmanager
def _w4a16_kernels(method: str):
    """``awq-gemv`` / ``gptq-gemv``: the engine's W4A16 decode launches take the CUDA-core GEMV kernel up to its
    row limit (``gemv_config``), to time it end to end before it is a default."""
    if not method.endswith("-gemv"):
        yield
        return
    from inference.quantization import triton_w4a16_decode as decode
    from inference.quantization.triton_w4a16_gemv import MAX_GEMV_ROWS
    from inference.quantization.triton_w4a16_launch import gemv_config
    library_config = decode.decode_config

    def with_gemv(M: int, N: int, K: int, num_sms: int):
        return (gemv_config if M <= MAX_GEMV_ROWS else library_config)(M, N, K, num_sms)
    decode.decode_config = with_gemv
    try:
        yield
    finally:
        decode.decode_config = library_config


def decode_latency(args, method: str) -> dict:
    """Mean seconds per decode step for each batch size, and the engine's weight memory."""
    max_model_len = args.prompt_len + args.decode_steps + 64 + 2 * AUTO_MAX_WINDOW
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", quantization=_quantization(method),
              max_model_len=max_model_len, max_num_seqs=max(args.batch_sizes),
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization)
    engine = llm.llm_engine
    memory = weight_memory(engine.runner.model)
    result = {"weights_GiB": memory.total_bytes / 2 ** 30, "weights_ratio_to_bf16": memory.total_ratio,
              "linear_weights_ratio_to_bf16": memory.quantized_ratio, "step_ms": {}, "timed_steps": {},
              "window_steps": {}}
    g = torch.Generator().manual_seed(0)
    vocab = engine.config.hf_config.vocab_size

    def steps_in_flight() -> int:
        return engine._inflight[0].num_steps if engine._inflight is not None else 0

    for batch in args.batch_sizes:
        # Every request may run to max_model_len: those that leave prefill first decode while others prefill.
        params = SamplingParams(temperature=0.0, max_tokens=max_model_len - args.prompt_len, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{method}-{batch}-{i}", torch.randint(100, vocab - 100, (args.prompt_len,),
                                                                       generator=g).tolist(), params)
        produced: dict[str, int] = {}

        def advance() -> None:
            for out in engine.step():
                produced[out.request_id] = len(out.outputs[0].token_ids) + produced.get(out.request_id, 0)

        while len(produced) < batch or min(produced.values()) < 3:  # prefill done, decode warmed up
            advance()
        windows = collections.Counter(engine.window_steps)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        before, first_window = dict(produced), steps_in_flight()
        start = time.perf_counter()
        # Decode windows (several steps per engine.step()) are on by default: count steps, not calls. The window in
        # flight at the start ran before it (its tokens arrive during the timing); the one in flight at the end is
        # timed (the synchronize) but its tokens arrive after.
        while min(produced[r] - before[r] for r in before) < args.decode_steps and engine.has_unfinished_requests():
            advance()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        steps = min(produced[r] - before[r] for r in before) - first_window + steps_in_flight()
        result["step_ms"][str(batch)] = 1000 * seconds / steps
        result["timed_steps"][str(batch)] = steps
        result["window_steps"][str(batch)] = {str(k): v for k, v in
                                             sorted((collections.Counter(engine.window_steps) - windows).items())}
        for request_id in before:  # the rest of each request's tokens are not needed
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        print(f"{method:>5} batch {batch:3d}: {result['step_ms'][str(batch)]:.3f} ms/step", flush=True)
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


def w1_throughput(args, method: str) -> dict:
    """W1 (``--w1-num-prompts`` x 1024 in / 512 out, the performance issue's workload) through run_tessera."""
    w1 = SimpleNamespace(model=args.model, dtype="bfloat16", load_format="dummy", max_model_len=2048,
                         max_num_seqs=256, max_num_batched_tokens=16384, kv_cache_space=4.0,
                         enforce_eager=args.enforce_eager, quantization=_quantization(method), workload="peer-w1",
                         num_prompts=args.w1_num_prompts, input_len=1024, output_len=512, seed=0)
    vocab = _vocab(args.model)
    prompts, outputs = make_workload(w1, vocab)
    result = run_tessera(w1, prompts, outputs)
    result.pop("hf_config")
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"{method:>5} W1: {result['output_tokens_per_s']:.1f} output tok/s", flush=True)
    return result


def _vocab(model: str) -> int:
    return model_config(model).vocab_size


def summary(result: dict) -> list[str]:
    """Compact lines: per-kernel speed-ups at each row count, decode step ms, W1 tok/s."""
    lines = []
    for shape, entry in result["kernels"].items():
        for rows, row in entry["rows"].items():
            base = row["bf16"]["ms"]
            lines.append(f"kernel {shape:>8} M={rows:>3}: bf16 {1000 * base:6.1f} us; " + ", ".join(
                f"{k} {base / v['ms']:.2f}x{'' if v['ok'] else ' WRONG'}" for k, v in row.items()
                if isinstance(v, dict) and k not in ("bf16", "sweep")))
    for method, entry in result["decode"].items():
        lines.append(f"decode {method:>5}: " + ", ".join(
            f"B{b} {ms:.2f} ms ({entry.get('speedup_vs_bf16', {}).get(b, float('nan')):.2f}x)"
            for b, ms in entry["step_ms"].items()) + f"; weights {entry['weights_GiB']:.2f} GiB")
    for method in ("bf16", "fp8"):
        if method in result["w1"]:
            lines.append(f"W1 {method}: {result['w1'][method]['output_tokens_per_s']:.0f} tok/s")
    if "fp8_speedup_vs_bf16" in result["w1"]:
        lines.append(f"W1 fp8 speed-up vs bf16: {result['w1']['fp8_speedup_vs_bf16']:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--methods", nargs="+", default=["bf16", "awq", "gptq", "fp8"],
                        choices=["bf16", "awq", "gptq", "fp8", "awq-gemv", "gptq-gemv"],
                        help="awq-gemv / gptq-gemv: decode through the CUDA-core W4A16 kernel up to 4 rows")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="leaves room for the next method's engine while Python frees the last one")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true", help="no kernel microbenchmarks")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of W4A16 decode-kernel configs")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--w1-num-prompts", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "model": args.model, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
              "kernels": {}, "decode": {}, "w1": {}}
    device = "h200" if "H200" in result["device"] else result["device"].split()[-1].lower()
    name = Path(args.model).name
    path = Path(args.output_json) if args.output_json else RESULTS / f"quantization_{name}_{device}.json"
    RESULTS.mkdir(exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    if not args.skip_kernels:
        if torch.cuda.is_available():
            result["kernels"] = run_microbenchmarks(model_config(args.model), args.batch_sizes, args.sweep)
            save()
        else:
            print("kernel microbenchmarks need CUDA: skipped")
    if not args.skip_decode:
        for method in args.methods:
            with _w4a16_kernels(method):
                result["decode"][method] = decode_latency(args, method)
            save()
        if "bf16" in result["decode"]:
            base = result["decode"]["bf16"]["step_ms"]
            for method, entry in result["decode"].items():
                entry["speedup_vs_bf16"] = {b: base[b] / ms for b, ms in entry["step_ms"].items()}
    if not args.skip_throughput:
        for method in [m for m in ("bf16", "fp8") if m in args.methods]:
            result["w1"][method] = w1_throughput(args, method)
            save()
        if "bf16" in result["w1"] and "fp8" in result["w1"]:
            result["w1"]["fp8_speedup_vs_bf16"] = (result["w1"]["fp8"]["output_tokens_per_s"]
                                                   / result["w1"]["bf16"]["output_tokens_per_s"])
    save()
    print("\n".join(["== summary =="] + summary(result)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
