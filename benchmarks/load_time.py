"""Start-up time of the offline engine from the converted-weights cache (the second and later loads).

    python benchmarks/load_time.py [--model smollm2-135m-instruct] [--repeats 3]

Each repeat is a fresh Python process: it reports the import time of the engine (torch and
transformers included) and the time of the ``LLM(...)`` constructor (config, tokenizer, weights,
KV cache). Writes JSON with the command to benchmarks/results/load_time.json.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import time, json, sys
t0 = time.perf_counter()
from inference import LLM
import transformers, transformers.models.llama.configuration_llama  # count the config import as import time
t1 = time.perf_counter()
LLM(model=sys.argv[1], kv_cache_space=1.0, max_model_len=2048)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "construct_s": t2 - t1, "total_s": t2 - t0}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-c", CHILD, args.model], cwd=ROOT, check=True, capture_output=True)  # fill the cache
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, args.model], cwd=ROOT, check=True,
                             capture_output=True, text=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(runs[-1])
    best = {key: min(r[key] for r in runs) for key in runs[0]}
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": args.model, "runs": runs, "best": best}
    out_path = ROOT / "benchmarks" / "results" / "load_time.json"
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"best: import {best['import_s']:.2f} s, LLM() {best['construct_s']:.2f} s -> {out_path}")


if __name__ == "__main__":
    main()
