"""The model runner: owns the weights and KV cache tensors, runs one step on the device."""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..config import EngineConfig
from ..core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ..errors import InvalidRequestError
from ..model_loader import iter_weights
from ..models import build_model
from ..sampling import Sampler, SamplingMetadata, compute_topk_logprobs
from .input_batch import prepare_inputs

logger = logging.getLogger(__name__)
GiB = 1 << 30


class ModelRunner:
    """Loads the model, sizes and allocates the paged KV cache, and executes scheduled steps.

    KV cache: one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    in the model dtype (index 0 = keys, 1 = values).
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int | None = None) -> None:
        self.config = config
        self.device = config.device
        hf = config.hf_config
        weights = None if config.load_format == "dummy" else iter_weights(config.model_dir)
        torch.manual_seed(config.seed)
        self.model = build_model(hf, config.dtype, self.device, config.max_model_len, weights)
        self.vocab_size = hf.vocab_size
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.block_size = config.cache.block_size
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.num_blocks = num_kv_blocks or self._profile_num_blocks()
        self.kv_caches = [self._zeros((2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim))
                          for _ in range(self.num_layers)]
        self.sampler = Sampler()
        self._log_memory()

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed KV tensor. On CPU it comes from calloc (numpy), whose large allocations are
        zero pages mapped lazily, so a multi-GiB pool costs nothing until blocks are written."""
        if self.device != "cpu" or self.config.dtype == torch.bfloat16:
            return torch.zeros(shape, dtype=self.config.dtype, device=self.device)
        np_dtype = {torch.float32: np.float32, torch.float16: np.float16}[self.config.dtype]
        return torch.from_numpy(np.zeros(shape, dtype=np_dtype))

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.config.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def _profile_num_blocks(self) -> int:
        cache = self.config.cache
        if self.device == "cpu":
            budget = cache.kv_cache_space * GiB
        else:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            used_by_others = total - free - torch.cuda.memory_allocated()
            activation = self._activation_peak_bytes()
            budget = total * cache.gpu_memory_utilization - used_by_others - self.weights_bytes - activation
        num_blocks = int(budget // self.bytes_per_block)
        max_len = self.config.max_model_len
        if num_blocks * self.block_size < max_len:
            raise InvalidRequestError(
                f"The KV cache has room for {max(num_blocks, 0) * self.block_size} tokens "
                f"({budget / GiB:.2f} GiB), fewer than one sequence of max_model_len={max_len}. "
                "Raise gpu_memory_utilization (GPU) or kv_cache_space (CPU), or lower max_model_len.",
                param="max_model_len")
        return num_blocks

    def _activation_peak_bytes(self) -> int:
        """Rough activation peak of the largest step: logits of max_num_seqs rows plus MLP intermediates."""
        hf, sched = self.config.hf_config, self.config.scheduler
        element = torch.tensor([], dtype=self.config.dtype).element_size()
        tokens = sched.max_num_batched_tokens
        mlp = tokens * hf.intermediate_size * 3 * element
        logits = sched.max_num_seqs * hf.vocab_size * 4 * 3
        return int(mlp + logits + 512 * (1 << 20))

    def _log_memory(self) -> None:
        kv_bytes = self.num_blocks * self.bytes_per_block
        max_len = self.config.max_model_len
        concurrency = self.num_blocks * self.block_size / max_len
        logger.info("Model weights take %.2f GiB; KV cache %.2f GiB = %d blocks of %d tokens; "
                    "maximum concurrency at max_model_len=%d: %.2fx",
                    self.weights_bytes / GiB, kv_bytes / GiB, self.num_blocks, self.block_size,
                    max_len, concurrency)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the forward pass of one step and sample a token for each request that reached its end."""
        inputs = prepare_inputs(sched_out, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        sampling = [s.request for s in sched_out.scheduled if s.samples]
        token_ids: list[int] = []
        logprobs: list = []
        if sampling:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            meta = SamplingMetadata.from_requests(sampling, self.vocab_size, self.device)
            sampled = self.sampler(logits, meta)
            token_ids = sampled.token_ids.tolist()
            logprobs = self._split_logprobs(sampling, sampled)
        prompt_logprobs = self._prompt_logprobs(sched_out, inputs, hidden)
        return ModelRunnerOutput(token_ids, logprobs, prompt_logprobs)

    @staticmethod
    def _split_logprobs(requests, sampled) -> list:
        if sampled.logprobs is None:
            return [None] * len(requests)
        ids, values, ranks = sampled.logprob_token_ids.cpu(), sampled.logprobs.cpu(), sampled.sampled_ranks.cpu()
        result = []
        for i, req in enumerate(requests):
            k = req.sampling_params.logprobs
            result.append(None if k is None else (ids[i, :k + 1], values[i, :k + 1], int(ranks[i])))
        return result

    def _prompt_logprobs(self, sched_out, inputs, hidden) -> dict:
        result = {}
        for item in sched_out.scheduled:
            req = item.request
            if req.request_id not in inputs.prompt_logprob_rows:
                continue
            first, scored = inputs.prompt_logprob_rows[req.request_id]
            rows = hidden[first:first + len(scored)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = torch.tensor([req.prompt_token_ids[p] for p in scored], device=logprobs.device)
            ids, values, ranks = compute_topk_logprobs(logprobs, targets, req.sampling_params.prompt_logprobs)
            result[req.request_id] = (ids.cpu(), values.cpu(), ranks.cpu())
        return result
