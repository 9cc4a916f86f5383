"""Tensor parallelism on CPU (gloo): the same greedy tokens as one rank, block copies and swaps on
every rank, clear start-up errors, and no rank process left behind (normal exit, garbage
collection, an error in a rank, a killed rank, a killed rank 0)."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference import LLM, InvalidRequestError, SamplingParams
from inference.distributed.partition import check_tensor_parallel_size, valid_tensor_parallel_sizes
from inference.distributed.rank_processes import TensorParallelError
from inference.distributed.rank_worker import FAULT_ENV
from inference.model_loader.dummy_models import DUMMY_MODEL_CONFIGS

from .conftest import make_tiny_model

NUM_TOKENS = 24
REPO = Path(__file__).resolve().parents[2]
# One configuration exercises every block operation: a pool of 10 blocks of 16 tokens for five
# requests of ~40-70 tokens forces preemption (swapped out and back in), and prefix caching with
# n=2 shares a prompt's last partial block until each sample copies it on write.
SMOLLM2_ARGS = dict(max_model_len=128, num_kv_blocks=10, enable_prefix_caching=True, preemption_mode="swap",
                    swap_space=0.01)


def _alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an orphan's exit may wait to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, n=n)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _rank_pids(llm: LLM) -> list[int]:
    return llm.llm_engine.runner.ranks.pids


# ---- start-up checks -------------------------------------------------------------------
def test_size_that_does_not_divide_the_heads_lists_the_valid_sizes():
    with pytest.raises(InvalidRequestError) as info:
        LLM(tensor_parallel_size=2, max_model_len=128)
    assert info.value.param == "tensor_parallel_size"
    assert "does not divide" in str(info.value) and "9 attention heads" in str(info.value)
    assert str(info.value).endswith("valid sizes: 1, 3, 9.")
    with pytest.raises(InvalidRequestError, match="at least 1") as info:
        LLM(tensor_parallel_size=0, max_model_len=128)
    assert info.value.param == "tensor_parallel_size"


def test_valid_sizes_follow_the_kv_heads_and_the_gpus():
    from transformers import Qwen2Config

    qwen7b = Qwen2Config(**{k: v for k, v in DUMMY_MODEL_CONFIGS["qwen2.5-7b"].items() if k != "architectures"})
    # 28 query heads, 4 KV heads: 7 and 14 divide the heads but would put two KV heads' queries on one rank.
    assert valid_tensor_parallel_sizes(qwen7b) == [1, 2, 4, 28]
    with pytest.raises(InvalidRequestError, match="cannot split or replicate .* 4 KV heads.*valid sizes: 1, 2, 4, 28"):
        check_tensor_parallel_size(7, qwen7b, "qwen2.5-7b", "cpu")
    check_tensor_parallel_size(2, qwen7b, "qwen2.5-7b", "cuda", num_devices=2)
    with pytest.raises(InvalidRequestError, match="needs 4 GPUs, but 2 are visible") as info:
        check_tensor_parallel_size(4, qwen7b, "qwen2.5-7b", "cuda", num_devices=2)
    assert info.value.param == "tensor_parallel_size"


# ---- SmolLM2, TP=3: 3 query heads and 1 KV head per rank ------------------------------------------
@pytest.fixture(scope="module")
def smollm2_pair():
    one = LLM(**SMOLLM2_ARGS)
    three = LLM(tensor_parallel_size=3, **SMOLLM2_ARGS)
    yield one, three
    pids = _rank_pids(three)
    three.close()
    assert _wait_gone(pids, 10) == []


@pytest.mark.timeout(600)
def test_smollm2_tp3_same_greedy_tokens_with_swaps(smollm2_pair, test_prompts):
    one, three = smollm2_pair
    prompts = test_prompts[:5]
    expected = _greedy(one, prompts)
    assert one.llm_engine.kv_cache_manager.num_swapped_out_total > 0  # the pool forced swaps
    assert _greedy(three, prompts) == expected
    kv = three.llm_engine.kv_cache_manager
    assert kv.num_swapped_out_total > 0 and kv.num_free_blocks == kv.num_blocks
    assert three.llm_engine.runner.num_blocks == 10 and len(_rank_pids(three)) == 2


@pytest.mark.timeout(600)
def test_smollm2_tp3_copy_on_write_of_shared_prompt_blocks(smollm2_pair, test_prompts):
    one, three = smollm2_pair
    prompt = test_prompts[0]  # 5 tokens: the two samples share its partial block, then copy it
    expected = _greedy(one, [prompt], n=2)
    assert expected[0][0] == expected[0][1]
    assert _greedy(three, [prompt], n=2) == expected


# ---- a tiny random Qwen2 (bias on Q/K/V, untied LM head), TP=2 ---------------------------------------
@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, smollm2_tokenizer) -> str:
    return str(make_tiny_model("qwen2", tmp_path_factory.mktemp("tp") / "qwen2", smollm2_tokenizer))


TINY_ARGS = dict(max_model_len=256, max_num_batched_tokens=32, kv_cache_space=0.05)


@pytest.mark.timeout(300)
def test_tiny_qwen2_tp2_same_greedy_tokens_and_clean_close(tiny_qwen2, filler_prompts):
    prompts = filler_prompts[:4]
    expected = _greedy(LLM(model=tiny_qwen2, **TINY_ARGS), prompts)
    with LLM(model=tiny_qwen2, tensor_parallel_size=2, **TINY_ARGS) as two:
        pids = _rank_pids(two)
        assert _greedy(two, prompts) == expected
    assert _wait_gone(pids, 10) == []
    with pytest.raises(TensorParallelError, match="closed"):
        two.generate(prompt_token_ids=prompts[:1], use_tqdm=False)


@pytest.mark.timeout(300)
def test_tiny_qwen2_tp2_steps_launched_ahead_give_the_same_tokens(tiny_qwen2, filler_prompts):
    """Async scheduling with two ranks: rank 0 broadcasts the tokens its previous step sampled on the
    device as the next step's inputs; greedy tokens equal one synchronous rank's, also for a request that
    ends early and one constrained by a regex (its bitmask filled while the ranks run the forward pass)."""
    prompts = filler_prompts[:4]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (NUM_TOKENS, 5, NUM_TOKENS)]
    params.append(SamplingParams(temperature=0, max_tokens=NUM_TOKENS, structured_outputs={"regex": "[a-z]{20,}"}))
    one = LLM(model=tiny_qwen2, async_scheduling=False, **TINY_ARGS)
    expected = [[o.token_ids for o in r.outputs] for r in one.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                        use_tqdm=False)]
    with LLM(model=tiny_qwen2, tensor_parallel_size=2, async_scheduling=True, **TINY_ARGS) as two:
        got = [[o.token_ids for o in r.outputs] for r in two.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                       use_tqdm=False)]
        assert two.llm_engine.num_steps_ahead > NUM_TOKENS // 2
    assert got == expected


@pytest.fixture(scope="module")
def filler_prompts():
    import random
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 90))] for _ in range(4)]


@pytest.mark.timeout(300)
def test_ranks_end_when_the_engine_is_garbage_collected(tiny_qwen2):
    llm = LLM(model=tiny_qwen2, tensor_parallel_size=2, **TINY_ARGS)
    pids = _rank_pids(llm)
    assert all(_alive(p) for p in pids)
    del llm
    gc.collect()
    assert _wait_gone(pids, 10) == []


@pytest.mark.timeout(300)
def test_error_in_a_rank_names_it_and_ends_the_others(tiny_qwen2, filler_prompts, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 raises in its third step
    llm = LLM(model=tiny_qwen2, tensor_parallel_size=2, **TINY_ARGS)
    pids = _rank_pids(llm)
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 failed: RuntimeError: injected fault") as info:
        _greedy(llm, filler_prompts[:2])
    assert info.value.rank == 1
    assert _wait_gone(pids, 10) == []
    with pytest.raises(TensorParallelError, match="rank 1"):  # the engine stays failed
        _greedy(llm, filler_prompts[:1])


@pytest.mark.timeout(300)
def test_error_in_a_rank_at_start_up(tiny_qwen2, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:0")  # rank 1 raises while rank 0 builds its part of the model
    children_before = set(_children())
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: RuntimeError: injected fault .* building"):
        LLM(model=tiny_qwen2, tensor_parallel_size=2, **TINY_ARGS)
    assert _wait_gone(sorted(set(_children()) - children_before), 10) == []


def _children() -> list[int]:
    """Process ids of this process's live children started by multiprocessing's spawn (the rank
    processes; not its resource tracker)."""
    me = os.getpid()
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            spawned = b"spawn_main" in (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] not in ("Z", "X") and spawned:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(300)
def test_killed_rank_is_named_in_the_error(tiny_qwen2, filler_prompts):
    llm = LLM(model=tiny_qwen2, tensor_parallel_size=2, **TINY_ARGS)
    (pid,) = _rank_pids(llm)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 1 failed: the process was killed by signal 9"):
        _greedy(llm, filler_prompts[:1])
    assert _wait_gone([pid], 5) == []


_RANK0_SCRIPT = """
import sys, time
from inference import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], tensor_parallel_size=2, max_model_len=256, kv_cache_space=0.05)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    print(*llm.llm_engine.runner.ranks.pids, flush=True)
    while True:  # keep stepping, so that a rank may be inside a collective when rank 0 dies
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
"""


@pytest.mark.timeout(300)
def test_ranks_exit_when_rank0_is_killed(tiny_qwen2, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(_RANK0_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, str(script), tiny_qwen2], stdout=subprocess.PIPE, env=env, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
        time.sleep(0.5)
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(pids, 10) == []


@pytest.mark.timeout(120)
def test_a_script_on_standard_input_gets_a_clear_error(tiny_qwen2):
    """The rank processes import the main script again, which ``python -`` cannot offer: the error says
    so (it used to be a rank failing with FileNotFoundError '<stdin>')."""
    code = ("from inference import LLM, InvalidRequestError\n"
            f"try:\n    LLM(model={tiny_qwen2!r}, tensor_parallel_size=2, max_model_len=256, kv_cache_space=0.05)\n"
            "except InvalidRequestError as error:\n    print(error.param, error)\n")
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    assert done.stdout.startswith("tensor_parallel_size ") and "standard input" in done.stdout, done.stderr[-2000:]
