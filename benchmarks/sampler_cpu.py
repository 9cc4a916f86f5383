"""The CPU sampler's draw: inversion (the default on the CPU) against the exponential race, side by side.

Two parts, alternating the two draws in one process:
  1. the draw alone on SmolLM2-sized rows (49,152 entries) at 1, 16, 64 and 256 rows, with the softmax's
     time for scale;
  2. the packaged SmolLM2 engine (``LLM.generate``) on 64 prompts of U[16, 256] tokens sampled at
     temperature 1.0, 128 tokens each, with the exponential race forced in for the "race" arm.

    python benchmarks/sampler_cpu.py --output-json benchmarks/results/cpu-sampler-draw_cpu_<date>.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from provenance import current_commit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM, SamplingParams  # noqa: E402
from inference.sampling import sampler as sampler_module  # noqa: E402
from inference.sampling.draws import draw_tokens, exponential_race  # noqa: E402

VOCAB = 49_152
DRAWS = {"inversion": draw_tokens, "race": exponential_race}


def time_ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def draw_alone(rows_list: list[int], rounds: int) -> dict:
    out = {}
    for rows in rows_list:
        probs = torch.randn(rows, VOCAB).softmax(-1)
        repeat = max(2, 256 // rows)
        times = {name: [] for name in (*DRAWS, "softmax")}
        for _ in range(rounds):
            for name, draw in DRAWS.items():
                times[name].append(time_ms(lambda: draw(probs, {}), repeat))
            times["softmax"].append(time_ms(lambda: probs.softmax(-1), repeat))
        med = {name: statistics.median(v) for name, v in times.items()}
        out[str(rows)] = {"ms_median": med, "ms_rounds": times, "race_over_inversion": med["race"] / med["inversion"]}
        print(f"{rows:4d} rows: inversion {med['inversion']:.2f} ms, race {med['race']:.2f} ms, "
              f"softmax {med['softmax']:.2f} ms", flush=True)
    return out


def engine_rounds(rounds: int, num_prompts: int, output_len: int) -> dict:
    llm = LLM()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, VOCAB - 100) for _ in range(rng.randint(16, 256))]}
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tok_s = {name: [] for name in DRAWS}
    for _ in range(rounds):
        for name, draw in DRAWS.items():
            sampler_module.draw_tokens = draw  # the sampler's module-level name: the race forced in for "race"
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tok_s[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            print(f"engine, {name}: {tok_s[name][-1]:.1f} output tok/s", flush=True)
    sampler_module.draw_tokens = draw_tokens
    med = {name: statistics.median(v) for name, v in tok_s.items()}
    return {"num_prompts": num_prompts, "output_len": output_len, "temperature": 1.0,
            "output_tokens_per_s": tok_s, "median": med, "inversion_over_race": med["inversion"] / med["race"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-rounds", type=int, default=3, help="0 skips the engine part")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    result = {"command": "python " + shlex.join(sys.argv), "commit": current_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.machine(),
              "torch_threads": torch.get_num_threads(), "vocab": VOCAB,
              "draw_alone": draw_alone(args.rows, args.rounds)}
    if args.engine_rounds:
        result["engine"] = engine_rounds(args.engine_rounds, args.num_prompts, args.output_len)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.output_json)


if __name__ == "__main__":
    main()
