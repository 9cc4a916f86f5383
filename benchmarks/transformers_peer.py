"""The peer of ``throughput.py``: transformers' ``generate`` on the engine's own weights, alone or in rounds
alternating with the engine's ``LLM.generate`` (the CPU comparisons)."""
from __future__ import annotations

import statistics
import time

import torch


def load_transformers(model_dir: str, device: str, dtype: str):
    """The same weights as the engine's (``hf_model_dir``: for a GGUF model, its float32 dequantized form)
    in transformers' ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()


def run_transformers(model_dir: str, device: str, dtype: str, prompts, outputs, batch_size: int) -> dict:
    return transformers_generate(load_transformers(model_dir, device, dtype), device, prompts, outputs, batch_size)


@torch.inference_mode()
def transformers_generate(model, device: str, prompts, outputs, batch_size: int) -> dict:
    """Greedy ``generate`` over the prompts in static batches of ``batch_size``, each batch to its longest
    requested output (counted as the requested tokens only)."""
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


def run_alternating(llm, rounds: int, prompts, outputs) -> dict:
    """``throughput.py --rounds R``: the workload R times through Tessera's ``LLM.generate`` and R times through transformers'
    ``generate`` (one static batch), in one process on the same weights and torch threads, alternating: round
    ``i`` runs Tessera first when ``i`` is even, transformers first when odd, so that a change in the machine's
    load (a shared CPU) reaches both sides alike. Both are warmed up first on four of the prompts. Reports output
    tok/s of every round, their medians and the ratio of the medians (with ``ratio_per_round``: Tessera's round
    over transformers' round beside it)."""
    from inference import SamplingParams  # the caller has put the repository on sys.path
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    peer = load_transformers(engine.config.model_dir, engine.config.device,
                             str(engine.config.dtype).replace("torch.", ""))

    def tessera(prompts=prompts, outputs=outputs) -> float:
        start = time.perf_counter()
        done = llm.generate(prompt_token_ids=prompts, sampling_params=params[:len(prompts)], use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in done) == sum(outputs)
        return sum(outputs) / elapsed

    def transformers(prompts=prompts, outputs=outputs) -> float:
        return transformers_generate(peer, engine.config.device, prompts, outputs, len(prompts))["output_tokens_per_s"]

    # warm-up on a few of the prompts, whole (a static batch of 64 through transformers takes minutes on a CPU)
    tessera(prompts[:4], outputs[:4]), transformers(prompts[:4], outputs[:4])
    ours, theirs = [], []
    for r in range(rounds):
        for side in ((tessera, transformers) if r % 2 == 0 else (transformers, tessera)):
            (ours if side is tessera else theirs).append(side())
        print(f"round {r}: Tessera {ours[-1]:8.2f}  transformers {theirs[-1]:8.2f} output tok/s")
    median = statistics.median
    return {"rounds": rounds, "tessera_output_tokens_per_s": ours, "transformers_output_tokens_per_s": theirs,
            "tessera_median": median(ours), "transformers_median": median(theirs),
            "ratio": median(ours) / median(theirs), "ratio_per_round": [a / b for a, b in zip(ours, theirs)],
            "device": engine.config.device, "dtype": str(engine.config.dtype), "hf_model_dir": engine.config.model_dir}
