"""Grammars compiled against the model's vocabulary, off the engine's step loop.

Compiling a constraint (:class:`.params.StructuredOutputsParams`) for a tokenizer takes
milliseconds for a small schema and can take much longer for a large one; it runs on a thread
of its own, so that the step loop keeps serving the other requests while a new schema compiles
(a request waits for its grammar outside the scheduler, see ``LLMEngine``). Compiled grammars
are cached by constraint: requests with a schema seen before start at once.

The backend is xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation
Engine for Large Language Models", MLSys 2025), vLLM's default.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from .params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (distinct constraints)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and caches the results.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary: padding).
        stop_token_ids: the ids that end a constrained output once the grammar is complete
            (the model's EOS ids).
        max_threads: threads one compilation may use.

    Attributes:
        compile_seconds: wall time of each compilation done so far, in seconds (cache misses only).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], max_threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self._compiler = None  # built on the compile thread: the tokenizer info takes 0.1-1 s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A future of the ``xgrammar.CompiledGrammar`` of ``params`` (done at once when cached).

        The future raises ``RuntimeError`` when compilation fails (rare: the params were
        checked when built)."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(key, f))
        return future

    def _forget_failure(self, key: tuple, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def prewarm(self) -> Future:
        """Build the vocabulary's tables now, on the compile thread (0.1-1 s: 49K-152K tokens), so that
        the first constrained request does not wait for them."""
        return self._pool.submit(self._backend)

    def _backend(self):
        if self._compiler is None:
            import xgrammar as xgr  # noqa: PLC0415

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
        return self._compiler

    def _compile(self, params: StructuredOutputsParams):
        started = time.perf_counter()
        compiled = self._backend().compile_grammar(params.build_grammar())
        elapsed = time.perf_counter() - started
        self.compile_seconds.append(elapsed)
        logger.debug("compiled a %s grammar in %.1f ms", params.kind, elapsed * 1e3)
        return compiled

    def close(self) -> None:
        """Stop the compile thread (pending compilations still finish)."""
        self._pool.shutdown(wait=False)


class GrammarState:
    """One sequence's place in its grammar: an ``xgrammar.GrammarMatcher`` over the compiled
    grammar, made once the compilation is done. Each sample of an ``n > 1`` request has its own.

    A step scheduled ahead (async scheduling) fills its bitmask before the scheduler has appended
    the previous step's token: the runner advances the matcher past that token early
    (:meth:`accept_ahead`), and the scheduler's :meth:`accept` of the same token then only returns
    the answer already known.

    Args:
        compiled: the future from :meth:`GrammarCompiler.compile`.
    """

    __slots__ = ("compiled", "_matcher", "_ahead")

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self._matcher = None
        self._ahead: tuple[int, bool] | None = None  # (token, accepted) advanced past before accept()

    @property
    def ready(self) -> bool:
        """The grammar is compiled (or failed to: see :attr:`error`)."""
        return self.compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self.compiled.exception() if self.compiled.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr  # noqa: PLC0415

            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it (nothing changes).

        Raises:
            RuntimeError: a token was accepted ahead and ``token_id`` is another one.
        """
        if self._ahead is not None:
            token, accepted = self._ahead
            self._ahead = None
            if token != token_id:
                raise RuntimeError(f"grammar advanced ahead past token {token}, then asked to accept {token_id}")
            return accepted
        return self.matcher.accept_token(token_id)

    def accept_ahead(self, token_id: int) -> None:
        """Advance past ``token_id``, sampled by a step whose tokens the scheduler has not appended
        yet, so that the next step's bitmask can be filled; the next :meth:`accept` takes it.

        Raises:
            RuntimeError: a token accepted ahead was not taken by :meth:`accept` yet.
        """
        if self._ahead is not None:
            raise RuntimeError("a grammar can run only one token ahead of its request")
        self._ahead = (token_id, self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (``[R, ceil(V / 32)]``
        int32 on the CPU; bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed).

        After a token accepted ahead that ends the request (refused, or completing the grammar),
        the row's token is thrown away: every token is allowed.
        """
        if self._ahead is not None and (not self._ahead[1] or self.matcher.is_terminated()):
            bitmask[row].fill_(-1)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (tokens dropped after they were accepted)."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
