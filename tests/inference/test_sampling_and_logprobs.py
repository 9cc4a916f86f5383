"""Logprobs against transformers, seeds, and sampling parameters as a user sees them."""
from __future__ import annotations

import pytest
import torch

from inference import LLM, SamplingParams
from .conftest import CHAT


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, kv_cache_space=0.5)


@pytest.mark.timeout(300)
def test_logprobs_match_transformers(llm, hf_smollm2, test_prompts):
    prompt = test_prompts[1]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = prompt + completion.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert abs(entry[token_id].logprob - row[token_id].item()) < 1e-4
        top_ids = row.topk(5).indices.tolist()
        assert set(top_ids) <= set(entry)
        for t in top_ids:
            assert abs(entry[t].logprob - row[t].item()) < 1e-4
        assert entry[token_id].rank == 1  # greedy picks the most likely token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4


def test_prompt_logprobs_of_a_one_token_prompt_are_one_none(llm):
    """As vLLM: an entry per prompt token, None for the first (no context predicts it)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    assert llm.generate(prompt_token_ids=[[1]], sampling_params=params, use_tqdm=False)[0].prompt_logprobs == [None]


@pytest.mark.timeout(300)
def test_seed_reproducible_alone_and_in_batch(llm, test_prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate(prompt_token_ids=[test_prompts[0]], sampling_params=seeded, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=30)
    batch = llm.generate(prompt_token_ids=test_prompts[1:5] + [test_prompts[0]] + test_prompts[5:],
                         sampling_params=[others] * 4 + [seeded] + [others] * 3, use_tqdm=False)
    assert batch[4].outputs[0].text == alone.outputs[0].text
    assert batch[4].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.timeout(300)
def test_sampling_parameters_take_effect(llm, test_prompts, smollm2_tokenizer):
    prompt = [test_prompts[4]]
    # logit_bias forcing one token: every sampled token is that token.
    forced = smollm2_tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0.8, logit_bias={forced: 100}, max_tokens=5))
    assert out[0].outputs[0].token_ids == [forced] * 5
    # top_k=1 equals greedy.
    greedy = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                          sampling_params=SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    top1 = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=1.5, top_k=1, max_tokens=16))[0].outputs[0].token_ids
    assert top1 == greedy
    # A strong frequency penalty keeps greedy output from repeating tokens as much.
    penal = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=48, frequency_penalty=2.0, ignore_eos=True))[0].outputs[0].token_ids
    plain = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True))[0].outputs[0].token_ids
    assert len(set(penal)) > len(set(plain))
    # n samples, each with its own index; min_tokens holds EOS back.
    outs = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                        sampling_params=SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, min_tokens=8))
    assert [o.index for o in outs[0].outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in outs[0].outputs)
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1


@pytest.mark.timeout(300)
def test_stop_strings_and_finish_reasons(llm, test_prompts, smollm2_tokenizer):
    prompt = [test_prompts[4]]
    base = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length"
    words = base.text.split()
    stop = words[len(words) // 2]
    cut = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert stop not in cut.text and base.text.startswith(cut.text)
    assert cut.text == base.text[:base.text.index(stop)]
    kept = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + stop
    # A stop token id ends the output and stays in token_ids.
    stop_id = base.token_ids[5]
    by_id = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]
    assert by_id.stop_reason == stop_id


@pytest.mark.timeout(300)
def test_stop_token_text_is_left_out_unless_included(llm, test_prompts, smollm2_tokenizer):
    prompt = [test_prompts[4]]
    base = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[5]  # ends the text "... <token 5>" (the bug kept its text, e.g. " 4," for ",")
    stop_text = smollm2_tokenizer.decode([stop_id])
    assert stop_text.strip()
    cut = base.token_ids.index(stop_id) + 1
    outputs = {}
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include, logprobs=0)
        out = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=params)[0].outputs[0]
        assert out.token_ids == base.token_ids[:cut] and (out.finish_reason, out.stop_reason) == ("stop", stop_id)
        assert len(out.logprobs) == cut and stop_id in out.logprobs[-1]  # the stop token keeps its logprob
        assert _streamed_text(llm, prompt[0], params) == out.text
        outputs[include] = out.text
    assert outputs[True] == outputs[False] + stop_text and base.text.startswith(outputs[True])


@pytest.mark.timeout(300)
def test_eos_text_is_left_out_unless_included(llm):
    texts = {}
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=120, skip_special_tokens=False,
                                spaces_between_special_tokens=False, include_stop_str_in_output=include)
        out = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.llm_engine.eos_token_ids
        texts[include] = out.text
    eos_text = llm.get_tokenizer().decode(out.token_ids[-1:])
    assert not texts[False].endswith(eos_text) and texts[True] == texts[False] + eos_text


def _streamed_text(llm, prompt: list[int], params: SamplingParams) -> str:
    """The text deltas of one request through ``LLMEngine.step()`` (what a server streams), joined;
    checks that only the last delta carries a finish reason."""
    engine, deltas = llm.llm_engine, []
    engine.add_request("streamed", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not deltas or deltas[-1].finish_reason is None
            deltas.extend(out.outputs)
    assert deltas[-1].finish_reason is not None
    return "".join(d.text for d in deltas)


@pytest.mark.timeout(300)
def test_min_tokens_holds_back_stop_strings(llm, test_prompts, smollm2_tokenizer):
    prompt = [test_prompts[4]]
    base = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = base.text.split()[1]  # a word among the first few tokens
    assert stop in base.text[:len(base.text) // 2]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    early = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=plain)[0].outputs[0]
    assert early.text == base.text[:base.text.index(stop)]
    # min_tokens past every token: the stop string is ordinary text and the output runs to max_tokens
    held = plain.clone(min_tokens=40)
    out = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=held)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (base.text, base.token_ids, "length", None)
    assert _streamed_text(llm, prompt[0], held) == base.text
    # min_tokens past the first match: the next match that ends in a later token's text stops it
    for min_tokens in range(1, 40):
        protected = smollm2_tokenizer.decode(base.token_ids[:min_tokens])
        if stop in protected:
            break
    assert base.text.startswith(protected)
    later = base.text.find(stop, len(protected) - len(stop) + 1)
    params = plain.clone(min_tokens=min_tokens)
    out = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=params)[0].outputs[0]
    assert out.text == (base.text if later < 0 else base.text[:later])
    assert out.finish_reason == ("length" if later < 0 else "stop") and stop in out.text
    assert _streamed_text(llm, prompt[0], params) == out.text


@pytest.mark.timeout(300)
def test_chat_uses_the_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))
    assert "<|im_start|>assistant" in out[0].prompt
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.timeout(300)
def test_eos_listed_in_stop_token_ids_still_ends_as_eos(llm, test_prompts):
    """vLLM checks EOS before ``stop_token_ids``: an EOS that is also listed ends the output with
    ``stop_reason`` None, as an EOS does."""
    prompt = [test_prompts[-1]]  # the chat-templated question: the model ends its answer with EOS
    base = llm.generate(prompt_token_ids=prompt, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert base.finish_reason == "stop" and base.stop_reason is None, base
    eos = base.token_ids[-1]
    listed = llm.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=64, stop_token_ids=[eos]))[0].outputs[0]
    assert (listed.token_ids, listed.finish_reason, listed.stop_reason) == (base.token_ids, "stop", None)
