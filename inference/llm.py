"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``, as in vLLM."""
from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from .engine import EngineArgs, LLMEngine
from .errors import InvalidRequestError
from .lora.request import LoRARequest
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams
from .validation import normalize_chat_messages, validate_text

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
                 priority: Sequence[int] | None = None, cache_salt: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate completions for all prompts, batched continuously; returns outputs in prompt order.

        Args:
            prompts: one text or a list of texts (or use ``prompt_token_ids``).
            sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar when there is more than one prompt.
            priority: one priority per prompt (lower runs earlier; needs ``scheduling_policy="priority"``).
            cache_salt: prefix-cache key of these prompts (see ``LLMEngine.add_request``).
            lora_request: the LoRA adapter of every prompt, or a list with one per prompt (None: the base
                model); needs ``enable_lora=True``.
        ``prompts`` may also hold vLLM's prompt dicts, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``;
        ``prompt_token_ids`` is a list of token-id lists (or one list for one prompt).

        Raises:
            InvalidRequestError: a bad prompt or parameter; nothing from this call stays queued.
        """
        inputs = _prompt_inputs(prompts, prompt_token_ids)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params]
            if len(params_list) != len(inputs) or not all(isinstance(p, SamplingParams) for p in params_list):
                raise InvalidRequestError("sampling_params must be one SamplingParams or a list of them, one per "
                                          f"prompt ({len(inputs)}); got {type(sampling_params).__name__}.",
                                          param="sampling_params")
        if priority is not None and len(priority) != len(inputs):
            raise InvalidRequestError("priority must have one value per prompt.", param="priority")
        ids = self._add_all(inputs, params_list, priority=priority, cache_salt=cache_salt,
                            lora_requests=_per_prompt(lora_request, len(inputs)))
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of them,
        formatted with the model's chat template (or ``chat_template``), with the LoRA adapter ``lora_request``.

        Raises:
            InvalidRequestError: the tokenizer has no chat template and none was given (param ``chat_template``).
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts "
                                      "(or a list of such lists).", param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        conversations = [normalize_chat_messages(list(c) if isinstance(c, tuple) else c) for c in conversations]
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("The tokenizer has no chat template; pass chat_template=...",
                                      param="chat_template")
        prompts = [tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template) for conv in conversations]
        for prompt in prompts:
            validate_text(prompt, "messages")
        token_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        ids = self._add_all(token_ids, [sampling_params or SamplingParams()] * len(token_ids), texts=prompts,
                            lora_requests=_per_prompt(lora_request, len(token_ids)))
        return self._run(ids, use_tqdm and len(ids) > 1)

    def _add_all(self, inputs: list, params_list: list[SamplingParams], texts: list[str] | None = None,
                 priority: Sequence[int] | None = None, cache_salt: str | None = None,
                 lora_requests: list[LoRARequest | None] | None = None) -> list[str]:
        engine = self.llm_engine
        ids: list[str] = []
        final_only: dict[int, SamplingParams] = {}  # one output per request: its text is decoded once, at the end
        try:
            for i, (prompt, params) in enumerate(zip(inputs, params_list)):
                if id(params) not in final_only:
                    final_only[id(params)] = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                params = final_only[id(params)]
                request_id = str(self._next_id)
                self._next_id += 1
                engine.add_request(request_id, prompt, params, prompt_text=texts[i] if texts else None,
                                   priority=priority[i] if priority else 0, cache_salt=cache_salt,
                                   lora_request=lora_requests[i] if lora_requests else None)
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


def _per_prompt(lora_request, num_prompts: int) -> list | None:
    """One LoRA request (or None) per prompt, from one for all or a list of them.

    Raises:
        InvalidRequestError: a list whose length is not the number of prompts (``param="lora_request"``).
    """
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts if lora_request is not None else None
    if not isinstance(lora_request, (list, tuple)) or len(lora_request) != num_prompts:
        raise InvalidRequestError(f"lora_request must be one LoRARequest or a list of them, one per prompt "
                                  f"({num_prompts}).", param="lora_request")
    return list(lora_request)


def _prompt_inputs(prompts, prompt_token_ids) -> list:
    """The prompts of one ``generate`` call as texts and token-id lists.

    Raises:
        InvalidRequestError: neither argument, or an item that is not a text, a token-id list or a prompt dict.
    """
    if prompt_token_ids is not None:
        if isinstance(prompt_token_ids, (list, tuple)) and prompt_token_ids and all(
                isinstance(t, int) for t in prompt_token_ids):
            prompt_token_ids = [prompt_token_ids]  # one prompt
        items, param = prompt_token_ids, "prompt_token_ids"
    elif prompts is None:
        raise InvalidRequestError("Pass prompts (texts) or prompt_token_ids.", param="prompts")
    else:
        items = [prompts] if isinstance(prompts, (str, dict)) else prompts
        param = "prompts"
    if not isinstance(items, (list, tuple)):
        raise InvalidRequestError(f"{param} must be a list, got {type(items).__name__}.", param=param)
    inputs: list = []
    for item in items:
        if isinstance(item, dict) and param == "prompts":
            if set(item) - {"prompt", "prompt_token_ids"} or len(item) != 1:
                raise InvalidRequestError("A prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids'; "
                                          f"got keys {sorted(item)}.", param="prompts")
            item = item.get("prompt", item.get("prompt_token_ids"))
        if isinstance(item, str) and param == "prompts":
            inputs.append(item)
        elif isinstance(item, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            inputs.append(list(item))
        else:
            expected = "a text, a token-id list or a prompt dict" if param == "prompts" else "a list of token ids"
            raise InvalidRequestError(f"Each item of {param} must be {expected}; got {type(item).__name__}.",
                                      param=param)
    return inputs


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
