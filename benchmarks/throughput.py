"""Offline throughput: Tessera's engine against Hugging Face transformers, side by side.

Both run on identical random token-id prompts in the same process. Throughput counts each
request's requested output tokens only (ignore_eos), so what transformers' static batch
computes past a request's own max_tokens is waste, not output.

    python benchmarks/throughput.py                       # CPU workload: SmolLM2, 64 prompts, lengths U[16, 256]
    python benchmarks/throughput.py --input-len 1024 --output-len 512 --num-prompts 256 \
        --model qwen2.5-7b --load-format dummy --dtype bfloat16   # GPU workload W1 (performance issue)

Writes JSON (figures and the exact command) to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)

    def length(fixed, low, high):
        return fixed if fixed else rng.randint(low, high)

    prompts, outputs = [], []
    for _ in range(args.num_prompts):
        prompts.append([rng.randrange(100, vocab_size - 100) for _ in range(length(args.input_len, args.min_len, args.max_len))])
        outputs.append(length(args.output_len, args.min_len, args.max_len))
    return prompts, outputs


def run_tessera(args, prompts, outputs) -> dict:
    llm = LLM(model=args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_space=args.kv_cache_space, enforce_eager=args.enforce_eager)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), "the engine produced a different number of tokens than requested"
    return {"seconds": elapsed, "output_tokens": produced, "output_tokens_per_s": produced / elapsed,
            "hf_model_dir": llm.llm_engine.config.model_dir, "device": llm.llm_engine.config.device,
            "dtype": str(llm.llm_engine.config.dtype)}


@torch.inference_mode()
def run_transformers(model_dir: str, device: str, dtype: str, prompts, outputs, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, lens = prompts[first:first + batch_size], outputs[first:first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = sum(outputs)
    return {"seconds": elapsed, "output_tokens": produced, "output_tokens_per_s": produced / elapsed,
            "batch_size": batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=0, help="fixed prompt length (0: uniform in [min, max])")
    parser.add_argument("--output-len", type=int, default=0, help="fixed output length (0: uniform in [min, max])")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-space", type=float, default=4.0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    parser.add_argument("--peer-batch-size", type=int, default=0, help="static batch size (0: all prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    from inference.model_loader import load_hf_config, resolve_model
    vocab = load_hf_config(resolve_model(args.model, load_format=args.load_format).model_dir).vocab_size
    prompts, outputs = make_workload(args, vocab)
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
              "workload": {"model": args.model, "num_prompts": len(prompts), "input_tokens": sum(map(len, prompts)),
                           "requested_output_tokens": sum(outputs)}}
    result["tessera"] = ours = run_tessera(args, prompts, outputs)
    print(f"Tessera:      {ours['output_tokens_per_s']:10.1f} output tok/s ({ours['seconds']:.1f} s)")
    if args.peer == "transformers":
        dtype = ours["dtype"].replace("torch.", "")
        peer = run_transformers(ours["hf_model_dir"], ours["device"], dtype, prompts, outputs,
                                args.peer_batch_size or len(prompts))
        result["transformers_generate"] = peer
        result["ratio"] = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
        print(f"transformers: {peer['output_tokens_per_s']:10.1f} output tok/s ({peer['seconds']:.1f} s)")
        print(f"ratio:        {result['ratio']:10.2f}x")
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.output_json) if args.output_json else RESULTS / f"throughput_{args.model.replace('/', '_')}_{ours['device']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
