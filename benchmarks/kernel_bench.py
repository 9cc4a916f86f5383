"""Each Triton kernel against its PyTorch reference, on a GPU, at Qwen2.5-7B's shapes.

Every case is first checked against its reference on the GPU (``ok`` and the largest absolute
error go into the results), then both are timed with ``triton.testing.do_bench`` (median of
CUDA-event timings, L2 flushed between runs; this includes the Python launch overhead, which
dominates kernels under ~30 us). The Triton side is also timed replayed from a CUDA graph
(``triton_graph_ms``, no launch overhead, no L2 flush), as the engine's decode step would run it.
Attention cases also report achieved bandwidth (decode: K/V bytes read) or arithmetic (prefill:
4 * D * Hq FLOPs per attended query-key pair), from ``triton_ms``.

    python benchmarks/kernel_bench.py                  # H200: writes benchmarks/results/kernels_h200.json
    python benchmarks/kernel_bench.py --only decode    # cases whose name contains "decode"
    python benchmarks/kernel_bench.py --only rotary,silu   # ... either of these

Exits 1 if any case disagrees with its reference (after timing all of them), 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).resolve().parent / "results"
# Qwen2.5-7B
HQ, HK, D, HIDDEN, INTER, BLOCK = 28, 4, 128, 3584, 18944, 16
TOL = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _tables(lengths: list[int], device) -> tuple[torch.Tensor, int]:
    """Shuffled disjoint block tables ``[B, max_blocks]`` int32 and the number of blocks used."""
    needed = [-(-n // BLOCK) for n in lengths]
    ids = torch.randperm(sum(needed) + 1, device=device)[:sum(needed)].int()
    table = torch.zeros(len(lengths), max(needed), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = ids[start:start + n]
        start += n
    return table, sum(needed) + 1


def _slots(table: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    out = []
    for i, (start, end) in enumerate(spans):
        pos = torch.arange(start, end, device=table.device)
        out.append(table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    return torch.cat(out)


def decode_case(batch: int, context: int, dtype) -> dict:
    from inference.attention.triton_ops import paged_decode_attention, paged_decode_attention_ref
    table, num_blocks = _tables([context] * batch, "cuda")
    cache = torch.randn(2, num_blocks, BLOCK, HK, D, dtype=dtype, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    scale = D ** -0.5
    nbytes = 2 * batch * context * HK * D * cache.element_size()
    return dict(
        name=f"decode_b{batch}_ctx{context}", shape=dict(batch=batch, context=context, hq=HQ, hk=HK, d=D),
        triton=lambda: paged_decode_attention(q, cache, table, lens, scale, out=out, max_seq_len=context),
        torch=lambda: paged_decode_attention_ref(q, cache, table, lens, scale),
        bytes=nbytes)


def prefill_case(name: str, batch: list[tuple[int, int]], dtype) -> dict:
    """``batch``: (context_len, query_len) per request; new K/V stored before the kernels run."""
    from inference.attention.triton_ops import (paged_prefill_attention, paged_prefill_attention_ref,
                                                store_kv_cache)
    table, num_blocks = _tables([c + n for c, n in batch], "cuda")
    cache = torch.randn(2, num_blocks, BLOCK, HK, D, dtype=dtype, device="cuda")
    tokens = sum(n for _, n in batch)
    q = torch.randn(tokens, HQ, D, dtype=dtype, device="cuda")
    k, v = torch.randn(2, tokens, HK, D, dtype=dtype, device="cuda")
    store_kv_cache(k, v, cache, _slots(table, [(c, c + n) for c, n in batch]))
    cu = torch.tensor([0] + torch.tensor([n for _, n in batch]).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ctx = torch.tensor([c for c, _ in batch], dtype=torch.int32, device="cuda")
    max_q, scale = max(n for _, n in batch), D ** -0.5
    out = torch.empty_like(q)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in batch)
    return dict(
        name=name, shape=dict(requests=len(batch), tokens=tokens, batch=batch if len(batch) <= 8 else "see name",
                              hq=HQ, hk=HK, d=D),
        triton=lambda: paged_prefill_attention(q, k, v, cache, cu, ctx, table, max_q, scale, out=out),
        torch=lambda: paged_prefill_attention_ref(q, k, v, cache, cu, ctx, table, max_q, scale),
        flops=4 * D * HQ * pairs, args=(q, k, v, cache, cu, ctx, table, max_q, scale, out))


def mixed_split_case(dtype) -> dict:
    """A step mixing 128 decodes (context 1,535) with two 512-token chunks after 1,024: the decodes
    through the decode kernel and the chunks through the prefill kernel, as the backend runs such a
    step ("triton"), against one prefill-kernel launch for all of them ("torch" column)."""
    from inference.attention.triton_ops import paged_decode_attention, paged_prefill_attention
    batch = [(1535, 1)] * 128 + [(1024, 512)] * 2
    case = prefill_case("mixed_split_128_decodes_then_2x512_after_1024", batch, dtype)
    q, k, v, cache, cu, ctx, table, max_q, scale, out = case.pop("args")
    d = 128
    lens, cu_rest = ctx[:d] + 1, cu[d:] - d

    def split():
        paged_decode_attention(q[:d], cache, table[:d], lens, scale, out=out[:d], max_seq_len=1536)
        paged_prefill_attention(q[d:], k[d:], v[d:], cache, cu_rest, ctx[d:], table[d:], max_q, scale, out=out[d:])
        return out
    one = torch.empty_like(out)
    case.update(triton=split, torch=lambda: paged_prefill_attention(q, k, v, cache, cu, ctx, table, max_q, scale,
                                                                      out=one))
    return case


def store_case(tokens: int, dtype) -> dict:
    from inference.attention.torch_ref import store_kv
    from inference.attention.triton_ops import store_kv_cache
    num_blocks = -(-tokens // BLOCK) * 4
    cache_t = torch.zeros(2, num_blocks, BLOCK, HK, D, dtype=dtype, device="cuda")
    cache_r = torch.zeros_like(cache_t)
    k, v = torch.randn(2, tokens, HK, D, dtype=dtype, device="cuda")
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:tokens]

    def run_triton():
        store_kv_cache(k, v, cache_t, slots)
        return cache_t

    def run_torch():
        store_kv(k, v, cache_r, slots)
        return cache_r
    return dict(name=f"store_kv_cache_t{tokens}", shape=dict(tokens=tokens, hk=HK, d=D), triton=run_triton,
                torch=run_torch, bytes=4 * tokens * HK * D * k.element_size())


def rotary_store_case(tokens: int, dtype) -> dict:
    """The rotary kernel writing the rotated keys and the values to the paged cache ("triton") against
    rotary then the store kernel ("torch" column), the unfused pair it replaces."""
    from inference.attention.triton_ops import store_kv_cache
    from inference.models import triton_layers as tl_layers
    from inference.models.layers import RotaryEmbedding
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1e6), D, 32768).to("cuda")
    rotary.reset_buffers()
    positions = torch.randint(0, 32768, (tokens,), device="cuda")
    qkv = torch.randn(tokens, (HQ + 2 * HK) * D, dtype=dtype, device="cuda")
    q, k, v = (t.view(tokens, -1, D) for t in qkv.split([HQ * D, HK * D, HK * D], dim=-1))
    num_blocks = -(-tokens // BLOCK) * 4
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:tokens]
    fused_cache = torch.zeros(2, num_blocks, BLOCK, HK, D, dtype=dtype, device="cuda")
    separate_cache = torch.zeros_like(fused_cache)
    q0, k0 = q.clone(), k.clone()

    def fused():
        tl_layers.rotary_embedding(positions, q, k, rotary.cos, rotary.sin, (v, fused_cache, slots))
        return fused_cache

    def separate():
        tl_layers.rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
        store_kv_cache(k, v, separate_cache, slots)
        return separate_cache

    def check():  # the same inputs for both: rotation is in place
        q.copy_(q0)
        k.copy_(k0)
        out = fused().clone()
        q.copy_(q0)
        k.copy_(k0)
        return out
    return dict(name=f"rotary_store_fused_vs_separate_t{tokens}", shape=dict(tokens=tokens, hq=HQ, hk=HK, d=D),
                triton=fused, torch=separate, check=check, bytes=2 * (q.numel() + 2 * k.numel()) * q.element_size())


def layer_cases(tokens: int, dtype) -> list[dict]:
    from inference.models import triton_layers as tl_layers
    from inference.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
    norm = RMSNorm(HIDDEN, 1e-6).to("cuda", dtype)
    x = torch.randn(tokens, HIDDEN, dtype=dtype, device="cuda")
    res = torch.randn_like(x)
    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=1e6), D, 32768).to("cuda")
    rotary.reset_buffers()
    positions = torch.randint(0, 32768, (tokens,), device="cuda")
    qkv = torch.randn(tokens, (HQ + 2 * HK) * D, dtype=dtype, device="cuda")
    q = qkv[:, :HQ * D].view(tokens, HQ, D)
    k = qkv[:, HQ * D:(HQ + HK) * D].view(tokens, HK, D)
    q0, k0 = q.clone(), k.clone()
    gate_up = torch.randn(tokens, 2 * INTER, dtype=dtype, device="cuda")
    e = x.element_size()

    def rotary_once():  # in place: the check restores the inputs first, the timed runs rotate again and again
        q.copy_(q0)
        k.copy_(k0)
        return tl_layers.rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    return [
        dict(name=f"rms_norm_t{tokens}", shape=dict(tokens=tokens, hidden=HIDDEN),
             triton=lambda: tl_layers.rms_norm(x, norm.weight, 1e-6), torch=lambda: norm(x), bytes=2 * x.numel() * e),
        dict(name=f"fused_add_rms_norm_t{tokens}", shape=dict(tokens=tokens, hidden=HIDDEN),
             triton=lambda: tl_layers.fused_add_rms_norm(x, res, norm.weight, 1e-6), torch=lambda: norm(x, res),
             bytes=4 * x.numel() * e),
        dict(name=f"rotary_t{tokens}", shape=dict(tokens=tokens, hq=HQ, hk=HK, d=D),
             triton=lambda: tl_layers.rotary_embedding(positions, q, k, rotary.cos, rotary.sin), check=rotary_once,
             torch=lambda: rotary(positions, q0, k0), bytes=2 * (q.numel() + k.numel()) * e),
        dict(name=f"silu_and_mul_t{tokens}", shape=dict(tokens=tokens, inter=INTER),
             triton=lambda: tl_layers.silu_and_mul(gate_up), torch=lambda: silu_and_mul(gate_up),
             bytes=3 * tokens * INTER * e),
        # SwiGLU quantized per token for the FP8 down projection: the row read once ("triton") against
        # the two-pass kernel it replaced ("torch" column), then 32 warps against the default 16; same
        # codes and scales.
        dict(name=f"silu_and_mul_fp8_one_read_vs_two_passes_t{tokens}", shape=dict(tokens=tokens, inter=INTER),
             triton=lambda: tuple(tl_layers.silu_and_mul(gate_up, fp8_out=True)[:2]),
             torch=lambda: _silu_and_mul_fp8_variant(gate_up, False, 8), bytes=2 * tokens * INTER * e + tokens * INTER),
        dict(name=f"silu_and_mul_fp8_one_read_w32_vs_w16_t{tokens}", shape=dict(tokens=tokens, inter=INTER),
             triton=lambda: _silu_and_mul_fp8_variant(gate_up, True, 32),
             torch=lambda: _silu_and_mul_fp8_variant(gate_up, True, 16), bytes=2 * tokens * INTER * e + tokens * INTER),
    ]


def _silu_and_mul_fp8_variant(gate_up: torch.Tensor, row_in_registers: bool, num_warps: int):
    """``(codes, scales)`` of the FP8 SwiGLU kernel launched with the given layout and warps."""
    import triton
    from inference.models.triton_layers import _silu_and_mul_fp8_kernel
    inter = gate_up.shape[1] // 2
    codes = torch.empty((gate_up.shape[0], inter), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty((gate_up.shape[0], 1), dtype=torch.float32, device=gate_up.device)
    head = 1 << (inter.bit_length() - 1) if row_in_registers else 2048
    tail = max(triton.next_power_of_2(inter - head), 16) if row_in_registers else 16
    _silu_and_mul_fp8_kernel[(gate_up.shape[0],)](gate_up, codes, scales, gate_up.stride(0), inter, FP8_MAX=448.0,
                                                  MIN_SCALE=1e-12, BLOCK=head, BLOCK_TAIL=tail,
                                                  ROW_IN_REGISTERS=row_in_registers, num_warps=num_warps)
    return codes, scales


def _check(case: dict, dtype) -> tuple[bool, float]:
    got, expected = case.get("check", case["triton"])(), case["torch"]()
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    ok, err = True, 0.0
    for g, e in zip(got, expected):
        err = max(err, (g.float() - e.float()).abs().max().item())
        ok = ok and bool(torch.isfinite(g.float()).all()) and torch.allclose(g.float(), e.float(), **TOL[dtype])
    return ok, err


def run_case(case: dict, dtype) -> dict:
    import triton
    ok, err = _check(case, dtype)
    t_ms = triton.testing.do_bench(case["triton"], warmup=25, rep=200, return_mode="median")
    r_ms = triton.testing.do_bench(case["torch"], warmup=5, rep=200, return_mode="median")
    try:  # kernel time without Python launch overhead, as in a CUDA-graph step (inputs may stay in L2)
        g_ms = triton.testing.do_bench_cudagraph(case["triton"], rep=100, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        print(f"{case['name']}: CUDA-graph timing failed: {exc}", file=sys.stderr)
        g_ms = None
    row = dict(name=case["name"], shape=case["shape"], ok=ok, max_abs_err=err, triton_ms=t_ms, torch_ms=r_ms,
               speedup=r_ms / t_ms, triton_graph_ms=g_ms)
    for key, unit, scale in (("bytes", "gb_per_s", 1e6), ("flops", "tflop_per_s", 1e9)):
        if key in case:
            row[f"triton_{unit}"] = case[key] / t_ms / scale
            row[f"triton_graph_{unit}"] = case[key] / g_ms / scale if g_ms else None
    return row


@torch.inference_mode()
def run_all(builders: list, only: str, dtype) -> list[dict]:
    rows = []
    for build in builders:
        built = build()
        for case in built if isinstance(built, list) else [built]:
            if not any(part in case["name"] for part in only.split(",")):
                continue
            row = run_case(case, dtype)
            rows.append(row)
            extra = (f"{row['triton_gb_per_s']:8.0f} GB/s" if "triton_gb_per_s" in row
                     else f"{row['triton_tflop_per_s']:8.1f} TFLOP/s" if "triton_tflop_per_s" in row else "")
            print(f"{row['name']:50s} {'ok ' if row['ok'] else 'BAD'} err {row['max_abs_err']:.2e}  "
                  f"triton {row['triton_ms']:8.4f} ms (graph {row['triton_graph_ms'] or float('nan'):8.4f})  "
                  f"torch {row['torch_ms']:8.4f} ms  x{row['speedup']:6.2f} {extra}",
                  flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--only", default="", help="run only cases whose name contains this (or, comma-separated, "
                                                   "any of these)")
    parser.add_argument("--out", default=str(RESULTS / "kernels_h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_bench.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    builders = [
        lambda: decode_case(256, 1536, dtype),
        lambda: decode_case(8, 8192, dtype),  # few long requests: the flash-decoding split path
        lambda: prefill_case("prefill_8x1024", [(0, 1024)] * 8, dtype),
        lambda: prefill_case("prefill_chunked_8x512_after_512", [(512, 512)] * 8, dtype),
        lambda: prefill_case("mixed_2x512_after_1024_plus_128_decodes_ctx1536",
                             [(1024, 512)] * 2 + [(1535, 1)] * 128, dtype),
        lambda: mixed_split_case(dtype),
        lambda: store_case(256, dtype),
        lambda: store_case(8192, dtype),
        lambda: rotary_store_case(256, dtype),
        lambda: layer_cases(256, dtype),
        lambda: layer_cases(8192, dtype),
    ]
    started = time.time()
    rows = run_all(builders, args.only, dtype)
    result = dict(
        command="python " + shlex.join(sys.argv), device=torch.cuda.get_device_name(), torch=torch.__version__,
        triton=triton.__version__, python=platform.python_version(), dtype=args.dtype,
        model_shapes=dict(model="Qwen2.5-7B", hq=HQ, hk=HK, head_dim=D, hidden=HIDDEN, intermediate=INTER,
                          block_size=BLOCK),
        seconds=time.time() - started, results=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
