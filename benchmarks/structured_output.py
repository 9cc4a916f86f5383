"""Structured output's cost: throughput with a JSON schema on every request against the same
requests unconstrained, the grammar compile times, and what a schema never seen before costs.

One engine, one run, three phases:

1. constrained: ``--num-prompts`` random prompts (lengths U[``--min-input``, ``--max-input``]),
   each with one of ``--num-schemas`` distinct JSON schemas (their grammars compiled in the first
   steps), at most ``--output-len`` tokens each, all at once (nano-vllm's W2 shape at the defaults);
2. unconstrained: the same prompts and output lengths without schemas; output tokens per second
   against phase 1 (phases 1 and 2 alternate ``--rounds`` times);
3. a late request: while ``--num-prompts`` unconstrained requests decode, one request with a schema
   arrives; its TTFT, and the others' time per output token before it arrived and while it runs.
   Twice, into the same batch: with a schema already compiled, then with one the engine has not seen
   (its grammar compiles beside the running steps).

Random weights (``--load-format dummy``) write random but grammatical JSON, so constrained
requests end when their grammar completes or at ``--output-len``; each unconstrained request then
generates as many tokens as its constrained run did, and the figure compared is output tokens per
second on the same work.

    python benchmarks/structured_output.py                            # CPU: SmolLM2, small
    python benchmarks/structured_output.py --model qwen2.5-0.5b --load-format dummy --dtype bfloat16 \
        --num-prompts 256 --min-input 100 --max-input 1024 --output-len 1024 --max-model-len 4096   # H200 (W2)

Writes JSON (figures, the command and the commit) to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from provenance import current_commit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def schemas(count: int, salt: str = "") -> list[dict]:
    """``count`` distinct object schemas of bounded strings, integers and enums."""
    out = []
    for i in range(count):
        properties = {f"field{salt}{i}_{j}": kind for j, kind in enumerate([
            {"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0, "maximum": 10_000},
            {"type": "string", "enum": ["red", "green", "blue"]}, {"type": "boolean"}][: 2 + i % 3])}
        out.append({"type": "object", "properties": properties, "required": list(properties),
                    "additionalProperties": False})
    return out


def run_batch(engine, prompts, params_of) -> tuple[float, int, dict, list[int]]:
    """All prompts at once; ``(seconds, output tokens, metrics by request, output tokens by prompt)``."""
    start, arrival = time.perf_counter(), time.monotonic()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{start}", prompt, params_of(i), arrival_time=arrival)
    tokens, metrics, lengths = 0, {}, [0] * len(prompts)
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = sum(len(o.token_ids) for o in out.outputs)
            tokens += new
            lengths[int(out.request_id[1:].split("-")[0])] += new
            if out.finished:
                metrics[out.request_id] = out.metrics
    return time.perf_counter() - start, tokens, metrics, lengths


def late_request_phase(engine, prompts, args, schema: dict, tag: str) -> dict:
    """``--num-prompts`` unconstrained requests decode (the others); after ``2 * --late-after-steps``
    decode steps, one request constrained by ``schema`` (at most 64 tokens) arrives. Its TTFT, and
    the others' time per output token over the last ``--late-after-steps`` steps before its arrival
    and from its arrival until it ends (wall time over the tokens one of the others received in
    those steps; the others run ``--output-len`` tokens, which must outlast it)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-bg{i}", prompt, _params(args, None, args.output_len))
    watched = f"{tag}-bg0"  # every other request receives the same tokens per step
    steps, arrival, first_token, late_done, decoding = [], None, None, False, 0
    while engine.has_unfinished_requests() and not late_done:
        started = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outs if o.request_id == watched)
        for out in outs:
            if out.request_id == tag and first_token is None and out.outputs and out.outputs[0].token_ids:
                first_token = time.monotonic()
            late_done = late_done or (out.request_id == tag and out.finished)
        if arrival is not None and not any(o.request_id == watched and o.finished for o in outs):
            steps.append((seconds, tokens, True))
        elif sum(1 for o in outs if o.outputs and o.outputs[0].token_ids) == len(prompts):  # all decode
            decoding += 1
            if decoding > args.late_after_steps:  # steady decode: the before span is these steps
                steps.append((seconds, tokens, False))
            if decoding == 2 * args.late_after_steps:
                arrival = time.monotonic()
                engine.add_request(tag, prompts[0], _params(args, schema, 64), arrival_time=arrival)
    for i in range(len(prompts)):
        engine.abort_request(f"{tag}-bg{i}")
    while engine.has_unfinished_requests():
        engine.step()

    def tpot(late: bool) -> float:
        span = [(s, t) for s, t, after in steps if after == late]
        return 1000 * sum(s for s, _ in span) / max(1, sum(t for _, t in span))

    return {"ttft_ms": 1000 * (first_token - arrival), "others_tpot_ms_before": tpot(False),
            "others_tpot_ms_while_it_runs": tpot(True)}


def _params(args, schema: dict | None, max_tokens: int | None = None) -> SamplingParams:
    constraint = {"structured_outputs": {"json": schema}} if schema is not None else {}
    return SamplingParams(temperature=0.8, max_tokens=max_tokens or args.output_len, ignore_eos=True,
                          **constraint)  # unseeded: the engine's seed makes the run repeatable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--min-input", type=int, default=16)
    parser.add_argument("--max-input", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--num-schemas", type=int, default=4)
    parser.add_argument("--late-after-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alternating unconstrained / constrained batches")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-space", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
              kv_cache_space=args.kv_cache_space, seed=args.seed)
    engine = llm.llm_engine
    rng = random.Random(args.seed)
    vocab = engine.runner.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(args.min_input, args.max_input))]
               for _ in range(args.num_prompts)]
    known = schemas(args.num_schemas)
    run_batch(engine, prompts[:2], lambda i: _params(args, None))  # warm-up
    free_s = free_tokens = constrained_s = constrained_tokens = 0
    for _ in range(args.rounds):  # alternating, so that a change of the machine's load hits both alike
        seconds, tokens, _, lengths = run_batch(engine, prompts, lambda i: _params(args, known[i % len(known)]))
        constrained_s, constrained_tokens = constrained_s + seconds, constrained_tokens + tokens
        # The same prompts unconstrained, each generating as many tokens as its constrained run did
        # (a grammar ends a request when its JSON is complete): the same work, with and without masks.
        seconds, tokens, _, _ = run_batch(engine, prompts, lambda i: _params(args, None, max(1, lengths[i])))
        free_s, free_tokens = free_s + seconds, free_tokens + tokens
    compile_ms = [1000 * s for s in engine.grammar_compiler.compile_seconds]
    # A request with a known schema, then one with a schema never seen, each into the same running batch.
    late = {"known_schema": late_request_phase(engine, prompts, args, known[0], "known"),
            "new_schema": late_request_phase(engine, prompts, args, schemas(1, salt="new")[0], "new")}
    result = {
        "command": "python " + shlex.join(sys.argv),
        "commit": current_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": engine.config.device,
        "workload": {"model": args.model, "num_prompts": args.num_prompts, "input": [args.min_input, args.max_input],
                     "output_len": args.output_len, "num_schemas": args.num_schemas,
                     "rounds": args.rounds},
        "unconstrained": {"seconds": free_s, "output_tokens": free_tokens, "output_tok_s": free_tokens / free_s},
        "constrained": {"seconds": constrained_s, "output_tokens": constrained_tokens,
                        "output_tok_s": constrained_tokens / constrained_s},
        "constrained_over_unconstrained": (constrained_tokens / constrained_s) / (free_tokens / free_s),
        "grammar_compile_ms": {"count": len(compile_ms), "median": statistics.median(compile_ms),
                               "max": max(compile_ms)},
        "late_request": late,
        "window_steps": {str(k): v for k, v in sorted(engine.window_steps.items())},
    }
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    name = f"structured-output_{result['device'].split(':')[0]}_{time.strftime('%Y-%m-%d')}.json"
    path = Path(args.output_json) if args.output_json else RESULTS / name
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
