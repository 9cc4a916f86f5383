"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``, as in vLLM."""
from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from .engine import EngineArgs, LLMEngine
from .errors import InvalidRequestError
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """An engine for offline batch inference.

    Takes the keyword arguments of :class:`EngineArgs` (vLLM's names), e.g.
    ``LLM(model="smollm2-135m-instruct", max_model_len=8192, max_num_seqs=16)``.

    Raises:
        ModelLoadError, UnsupportedArchitectureError, InvalidRequestError, NotSupportedYetError.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs))
        self._next_id = 0

    def close(self) -> None:
        """End the engine's tensor-parallel rank processes now (they also end when this object is
        garbage-collected or the interpreter exits)."""
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 priority: Sequence[int] | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate completions for all prompts, batched continuously; returns outputs in prompt order.

        Args:
            prompts: one text or a list of texts (or use ``prompt_token_ids``).
            sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar when there is more than one prompt.
            priority: one priority per prompt (lower runs earlier; needs ``scheduling_policy="priority"``).
            cache_salt: prefix-cache key of these prompts (see ``LLMEngine.add_request``).
        Raises:
            InvalidRequestError: a bad prompt or parameter; nothing from this call stays queued.
        """
        if prompt_token_ids is not None:
            inputs: list = [list(p) for p in prompt_token_ids]
        elif isinstance(prompts, str):
            inputs = [prompts]
        else:
            inputs = list(prompts or [])
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(inputs):
                raise InvalidRequestError("sampling_params must be one object or one per prompt.",
                                          param="sampling_params")
        if priority is not None and len(priority) != len(inputs):
            raise InvalidRequestError("priority must have one value per prompt.", param="priority")
        ids = self._add_all(inputs, params_list, priority=priority, cache_salt=cache_salt)
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of them,
        formatted with the model's chat template (or ``chat_template``).

        Raises:
            InvalidRequestError: the tokenizer has no chat template and none was given (param ``chat_template``).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or any(not conversation for conversation in conversations):
            raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts "
                                      "(or a list of such lists).", param="messages")
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("The tokenizer has no chat template; pass chat_template=...",
                                      param="chat_template")
        prompts = [tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template) for conv in conversations]
        token_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        ids = self._add_all(token_ids, [sampling_params or SamplingParams()] * len(token_ids), texts=prompts)
        return self._run(ids, use_tqdm and len(ids) > 1)

    def _add_all(self, inputs: list, params_list: list[SamplingParams], texts: list[str] | None = None,
                 priority: Sequence[int] | None = None, cache_salt: str | None = None) -> list[str]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(inputs, params_list)):
                request_id = str(self._next_id)
                self._next_id += 1
                engine.add_request(request_id, prompt, params, prompt_text=texts[i] if texts else None,
                                   priority=priority[i] if priority else 0, cache_salt=cache_salt)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids, report=False)  # nothing of this call stays queued
            raise
        return ids

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        texts: dict[str, dict[int, list[str]]] = {}  # request -> sample index -> text deltas, joined at the end
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not show_progress)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                merged = results.get(delta.request_id)
                if merged is None:
                    merged = results[delta.request_id] = copy.copy(delta)
                    merged.outputs = []
                    texts[delta.request_id] = {}
                _merge(merged, delta, texts[delta.request_id])
                if delta.finished:
                    bar.update(1)
        bar.close()
        for request_id, out in results.items():
            for output in out.outputs:
                output.text = "".join(texts[request_id][output.index])
            out.outputs.sort(key=lambda o: o.index)
        return [results[i] for i in ids]


def _merge(merged: RequestOutput, delta: RequestOutput, texts: dict[int, list[str]]) -> None:
    """Add a step's delta to the merged output; text goes to ``texts`` (joined once at the end:
    appending to a string attribute would copy the whole text at every step)."""
    outputs, by_index = merged.outputs, None
    for part in delta.outputs:
        if len(outputs) == 1 and outputs[0].index == part.index:  # n=1: no index needed
            target = outputs[0]
        else:
            if by_index is None:
                by_index = {o.index: o for o in outputs}
            target = by_index.get(part.index)
            if target is None:
                target = by_index[part.index] = CompletionOutput(index=part.index)
                outputs.append(target)
                texts[part.index] = []
        texts[part.index].append(part.text)
        target.token_ids.extend(part.token_ids)
        if part.logprobs is not None:
            if target.logprobs is None:
                target.logprobs = []
            target.logprobs.extend(part.logprobs)
        target.cumulative_logprob = part.cumulative_logprob
        if part.finish_reason is not None:
            target.finish_reason, target.stop_reason = part.finish_reason, part.stop_reason
    if delta.prompt_logprobs is not None:
        merged.prompt_logprobs = delta.prompt_logprobs
    merged.finished = delta.finished
    merged.metrics = delta.metrics
