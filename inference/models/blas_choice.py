"""cuBLAS or cuBLASLt for each dense 16-bit layer's GEMMs in the CUDA graphs, chosen by timing both at start-up.

Why: ``torch.nn.functional.linear`` goes through cuBLAS by default, and cuBLASLt's kernels are faster for some
shapes and slower for others. On an H200 at 50 rows of the Qwen2.5-7B shape (``gemm-sweep-w3_h200_2026-12-06.json``,
µs): gate_up 71.8 against 78.4, down 37.9 against 40.5, the LM head 261 against 296, but qkv 11.8 against 10.9.
Torch's global switch (``torch.backends.cuda.preferred_blas_library``) takes the losses with the gains, and
cuBLASLt's host time per call (it asks its heuristics for an algorithm on every call) slowed W2's eager steps: on an
H100, W2 ran 3.4-6.7% slower with it, W3 1.2% faster.

So the runner times both libraries on every distinct dense layer shape (the model's own weights: each kind's layers
one after another, as a decode step reads them) at every row count its graphs capture, each timing a CUDA graph
replay (device time only), and a layer keeps in ``lt_rows`` the row counts at which cuBLASLt took at most
``MARGIN`` of cuBLAS's time. :func:`.parallel_layers.linear` takes cuBLASLt for those calls only while a CUDA graph is
being captured: a replay costs no host time, and eager calls (prompt chunks beyond the graphs, ``enforce_eager``)
keep cuBLAS. float32 weights keep cuBLAS (the float32 checks against transformers stay on one library).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ENABLED = True  # a benchmark knob (--no-blas-choice): keep every GEMM on cuBLAS
MARGIN = 0.97  # cuBLASLt must take at most this fraction of cuBLAS's time: a tie stays on the default
ROUNDS = 3  # timed replays of each library's graph, alternating; the median counts
DTYPES = (torch.float16, torch.bfloat16)


def lt_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`torch.nn.functional.linear` through cuBLASLt (torch's preferred BLAS library set for this call only)."""
    previous = torch._C._get_blas_preferred_backend()
    torch._C._set_blas_preferred_backend(torch._C._BlasBackend.Cublaslt)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_blas_preferred_backend(previous)


@dataclass
class GemmKind:
    """The dense layers of one GEMM shape: ``weights[i] [N, K]`` and ``biases[i] [N]`` or None, as their forward
    passes them to :func:`.parallel_layers.linear`; ``owners[i]`` the ``(object, attribute)`` that holds its
    cuBLASLt row counts."""

    name: str
    weights: list[torch.Tensor] = field(default_factory=list)
    biases: list[torch.Tensor | None] = field(default_factory=list)
    owners: list[tuple[object, str]] = field(default_factory=list)


def dense_kinds(model: torch.nn.Module) -> list[GemmKind]:
    """The model's dense 16-bit GEMMs grouped by shape: every Column/RowParallelLinear whose weight is float16
    or bfloat16 (quantized layers have their own kernels), and the LM head (``model.lm_head_weight``, whose
    ``lm_head_lt_rows`` the model passes to the logits' GEMM)."""
    from .parallel_layers import ColumnParallelLinear, RowParallelLinear  # noqa: PLC0415 - they import this module
    kinds: dict[tuple, GemmKind] = {}

    def add(name: str, weight: torch.Tensor, bias: torch.Tensor | None, owner: tuple[object, str]) -> None:
        if weight.dtype not in DTYPES:
            return
        kind = kinds.setdefault((tuple(weight.shape), weight.dtype, bias is not None), GemmKind(name))
        kind.weights.append(weight)
        kind.biases.append(bias)
        kind.owners.append(owner)

    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear):
            add(name.rsplit(".", 1)[-1], module.weight, module.bias, (module, "lt_rows"))
        elif isinstance(module, RowParallelLinear):  # with tensor parallelism the bias is added after the sum
            add(name.rsplit(".", 1)[-1], module.weight, module.bias if module.tp.world_size == 1 else None,
                (module, "lt_rows"))
    head = getattr(model, "lm_head_weight", None)
    if isinstance(head, torch.Tensor):
        add("lm_head", head, None, (model, "lm_head_lt_rows"))
    return list(kinds.values())


def graph_seconds(run: Callable[[], None]) -> Callable[[], float]:
    """Capture ``run`` in a CUDA graph; returns a function that replays it once and returns its device seconds."""
    run()  # warm-up outside the capture (cuBLASLt picks its algorithm, the allocator grows)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # its own memory pool, freed with the graph
        run()
    graph.replay()

    def replay() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    replay.graph = graph  # kept alive until the caller drops the function
    return replay


@dataclass
class BlasChoice:
    """What :func:`choose` decided: per kind, the row counts that take cuBLASLt, and the device seconds per step
    (all timed row counts summed) with cuBLAS only and with the choice."""

    lt_rows: dict[str, list[int]] = field(default_factory=dict)
    cublas_seconds: float = 0.0
    chosen_seconds: float = 0.0
    seconds_taken: float = 0.0
    error: str | None = None  # why cuBLASLt could not be timed (every layer then keeps cuBLAS)

    @property
    def saving(self) -> float:
        """The fraction of cuBLAS's GEMM time (summed over the kinds and timed row counts) that the choice saves."""
        return 1 - self.chosen_seconds / self.cublas_seconds if self.cublas_seconds else 0.0

    def describe(self) -> str:
        if self.error:
            return f"cuBLAS for every dense GEMM (cuBLASLt could not be timed: {self.error})"
        chosen = {name: rows for name, rows in self.lt_rows.items() if rows}
        if not chosen:
            return f"cuBLAS for every dense GEMM (timed against cuBLASLt in {self.seconds_taken:.1f} s)"
        parts = ", ".join(f"{name} at {_ranges(rows)} rows" for name, rows in chosen.items())
        return (f"cuBLASLt for {parts}; cuBLAS elsewhere ({self.saving:.1%} less GEMM time over the timed row counts; "
                f"timed in {self.seconds_taken:.1f} s)")


def choose(model: torch.nn.Module, row_counts: Iterable[int],
           timer: Callable[[Callable[[], None]], Callable[[], float]] = graph_seconds) -> BlasChoice:
    """Time cuBLAS against cuBLASLt for each dense GEMM kind of ``model`` at each of ``row_counts`` and set the
    owners' ``lt_rows`` (frozensets of row counts; the model's ``lm_head_lt_rows`` for the LM head).

    Args:
        row_counts: the GEMMs' row counts the CUDA graphs will capture (decode batch buckets, piecewise token
            buckets).
        timer: ``timer(run) -> replay`` returning one replay's device seconds (:func:`graph_seconds`;
            tests pass a fake).
    Returns:
        The decision and its timings, for the start-up log. Where cuBLASLt cannot run (a torch built without
        it, a capture that fails), every layer keeps cuBLAS and ``error`` says why: start-up goes on.
    """
    started = time.perf_counter()
    result = BlasChoice()
    kinds = dense_kinds(model) if ENABLED else []
    if not kinds:
        return result
    counts = sorted(set(row_counts))
    chosen: list[tuple[GemmKind, frozenset[int]]] = []
    try:
        with torch.inference_mode():
            for kind in kinds:
                lt = set()
                for rows in counts:
                    t_cublas, t_lt = _time_both(kind, rows, timer)
                    use_lt = t_lt <= MARGIN * t_cublas
                    if use_lt:
                        lt.add(rows)
                    result.cublas_seconds += t_cublas
                    result.chosen_seconds += t_lt if use_lt else t_cublas
                chosen.append((kind, frozenset(lt)))
                result.lt_rows[kind.name] = sorted(lt)
        if timer is graph_seconds:
            torch.cuda.synchronize()
    except RuntimeError as exc:  # every layer stays on cuBLAS, as before this module existed
        result = BlasChoice(error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        chosen = []
    for kind, lt in chosen:  # all or nothing
        for owner, attribute in kind.owners:
            setattr(owner, attribute, lt)
    result.seconds_taken = time.perf_counter() - started
    return result


def _time_both(kind: GemmKind, rows: int, timer) -> tuple[float, float]:
    """Median device seconds of ``kind``'s GEMMs at ``rows`` rows through cuBLAS and through cuBLASLt."""
    first = kind.weights[0]
    x = torch.zeros(rows, first.shape[1], dtype=first.dtype, device=first.device).normal_(0, 1)

    def run_all(use_lt: bool) -> None:
        call = lt_linear if use_lt else F.linear
        for weight, bias in zip(kind.weights, kind.biases):
            call(x, weight, bias)

    cublas = timer(lambda: run_all(False))
    cublaslt = timer(lambda: run_all(True))
    times_cublas, times_lt = [], []
    for _ in range(ROUNDS):  # alternating: clocks and neighbours drift alike for both
        times_cublas.append(cublas())
        times_lt.append(cublaslt())
    return statistics.median(times_cublas), statistics.median(times_lt)


def _ranges(rows: list[int]) -> str:
    """A short form of a sorted list of row counts for the log: all of them up to 4, else the span and count."""
    return ", ".join(map(str, rows)) if len(rows) <= 4 else f"{rows[0]}-{rows[-1]} ({len(rows)} counts)"
