"""One long prompt's prefill on CPU, Tessera against transformers (SDPA) on the same weights, side by side.

Tessera: ``LLM.generate`` of one ``--input-len``-token prompt with ``max_tokens=1`` and a token budget
that holds the whole prompt (one prefill step). transformers: one forward pass of the same ids through
``AutoModelForCausalLM`` loaded from the engine's converted checkpoint, float32. Each is timed
``--repeats`` times after one warm-up; the JSON (with the exact command) goes to
``benchmarks/results/prefill_cpu.json``.

    python benchmarks/prefill_cpu.py --input-len 3000
"""
from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inference import LLM, SamplingParams  # noqa: E402


def _seconds(run, repeats: int) -> list[float]:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(round(time.perf_counter() - start, 3))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--input-len", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    import transformers
    from throughput import write_result

    llm = LLM(model=args.model, device="cpu", max_model_len=max(8192, args.input_len + 1),
              max_num_batched_tokens=args.input_len + 1, kv_cache_space=0.5)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(args.input_len)]
    ours = _seconds(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1),
                                         use_tqdm=False), args.repeats)
    model = transformers.AutoModelForCausalLM.from_pretrained(llm.llm_engine.config.model_dir, dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        peer = _seconds(lambda: model(torch.tensor([prompt])), args.repeats)
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "torch_threads": torch.get_num_threads(), "model": args.model, "input_len": args.input_len,
              "tessera_seconds": ours, "transformers_sdpa_seconds": peer,
              "ratio_median": sorted(ours)[len(ours) // 2] / sorted(peer)[len(peer) // 2]}
    print(f"prefill of {args.input_len} tokens: Tessera {ours} s, transformers {peer} s")
    write_result(result, args.output_json, "prefill_cpu.json")


if __name__ == "__main__":
    main()
