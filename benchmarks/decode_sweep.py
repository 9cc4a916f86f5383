"""The decode attention kernel's launch grid at one model's shape: KV splits, keys per iteration, warps, stages.

W2 (Qwen2.5-0.5B: 14 query heads, 2 KV heads, head size 64) decodes up to 256 requests whose contexts
run from 100 to 2,048 tokens; each (request, KV head) program reads little, so the split count and the
inner tile decide how well the SMs are used. Contexts are drawn uniform in ``--context-range`` (seeded),
block tables shuffled. Every config is checked against the default launch's output, then timed by CUDA
graph replay (``triton.testing.do_bench_cudagraph``); K/V bytes read give the bandwidth. Also timed at the
default launch: the merge kernel's query heads per program (``reduce_heads``), and other cache layouts
(``--block-sizes``; ``--layouts head``: each block stored ``[Hk, block_size, D]``, so that one head's keys of
a block are contiguous, read through the same kernel by its strides).

    python benchmarks/decode_sweep.py --model .gpucache/qwen2.5-0.5b --batch-sizes 256 128 --output-json OUT.json
"""
from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_kernels import model_config  # noqa: E402

BLOCK = 16
REDUCE_HEADS = (1, 2, 4, 8, 16)


# (splits, keys per iteration, warps, stages): the full grid, and the neighbourhood of the defaults
GRIDS = {"full": ((1, 2, 4, 8, 16), (32, 64, 128), (2, 4), (2, 3)),
         "long": ((4, 8, 16), (64, 128), (4, 8), (2, 3, 4)),
         "quick": ((2, 4, 8), (64, 128), (4,), (2, 3))}


def paged_inputs(batch: int, lo: int, hi: int, hq: int, hk: int, d: int, max_seq_len: int, block: int = BLOCK,
                 layout: str = "token"):
    """Seeded contexts, a shuffled block table and random cache and queries: ``(q, cache, table, seq_lens)``;
    with ``layout="head"`` the cache is stored ``[2, blocks, Hk, block, D]`` and returned as its permuted view."""
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g)
    needed = [-(-int(n) // block) for n in lens]
    ids = torch.randperm(sum(needed), generator=g).int()
    table = torch.zeros(batch, max_seq_len // block, dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        table[i, :n] = ids[start:start + n]
        start += n
    if layout == "head":
        cache = torch.randn(2, sum(needed), hk, block, d, dtype=torch.bfloat16, device="cuda").permute(0, 1, 3, 2, 4)
    else:
        cache = torch.randn(2, sum(needed), block, hk, d, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    return q, cache, table.cuda(), lens.int().cuda()


def bench_layouts(batch: int, lo: int, hi: int, hq: int, hk: int, d: int, max_seq_len: int, block_sizes,
                  layouts) -> list[dict]:
    """The default launch over each (block size, layout) cache, and over each merge-kernel head count."""
    import triton

    from inference.attention.triton_decode import choose_num_splits, paged_decode_attention, reduce_heads
    rows = []
    for block, layout in itertools.product(block_sizes, layouts):
        q, cache, table, seq_lens = paged_inputs(batch, lo, hi, hq, hk, d, max_seq_len, block, layout)
        nbytes = 2 * int(seq_lens.sum()) * hk * d * 2
        splits = choose_num_splits(batch, hk, max_seq_len, q.device)
        ref = paged_decode_attention(q, cache.contiguous(), table, seq_lens, d ** -0.5, max_seq_len=max_seq_len,
                                     launch={"reduce_heads": 1})
        default_heads = reduce_heads(hq, splits, triton.next_power_of_2(d))
        for heads in REDUCE_HEADS if (block, layout) == (BLOCK, "token") else (default_heads,):
            out = torch.empty_like(q)

            def call(heads=heads, out=out):
                return paged_decode_attention(q, cache, table, seq_lens, d ** -0.5, out=out, max_seq_len=max_seq_len,
                                              launch={"reduce_heads": heads})
            row = dict(block_size=block, layout=layout, splits=splits, reduce_heads=heads,
                       default=heads == default_heads)
            try:
                err = (call().float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - one failing case does not end the sweep
                rows.append(dict(row, error=str(exc).splitlines()[0][:160]))
                continue
            rows.append(dict(row, us=ms * 1000, GBps=nbytes / ms / 1e6, max_abs_err=err, ok=err < 3e-2))
            print(f"batch {batch} block {block} layout {layout} splits {splits} reduce_heads {heads}"
                  f"{' (default)' if heads == default_heads else ''}: {ms * 1000:.1f} us {nbytes / ms / 1e6:.0f} GB/s "
                  f"(error {err:.2g})", flush=True)
    return rows


def bench_batch(batch: int, lo: int, hi: int, hq: int, hk: int, d: int, max_seq_len: int, grid: str,
                kv_cache_dtype: str = "auto") -> dict:
    import triton

    from inference.attention.kv_quant import FP8_DTYPE
    from inference.attention.triton_decode import choose_num_splits, decode_launch, paged_decode_attention
    q, cache, table, seq_lens = paged_inputs(batch, lo, hi, hq, hk, d, max_seq_len)
    if kv_cache_dtype == "fp8":
        cache = cache.to(FP8_DTYPE)
    lens = seq_lens.cpu()
    scale = d ** -0.5
    nbytes = 2 * int(lens.sum()) * hk * d * cache.element_size()
    default_splits = choose_num_splits(batch, hk, max_seq_len, q.device)
    ref = paged_decode_attention(q, cache, table, seq_lens, scale, max_seq_len=max_seq_len)
    rows = []
    for splits, block_n, warps, stages in itertools.product(*GRIDS[grid]):
        launch = dict(block_n=block_n, num_warps=warps, num_stages=stages)
        out = torch.empty_like(q)

        def call(launch=launch, splits=splits, out=out):
            return paged_decode_attention(q, cache, table, seq_lens, scale, out=out, max_seq_len=max_seq_len,
                                          num_splits=splits, launch=launch)
        try:
            err = (call().float() - ref.float()).abs().max().item()
            ms = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory or registers
            rows.append(dict(splits=splits, **launch, error=str(exc).splitlines()[0][:160]))
            continue
        rows.append(dict(splits=splits, **launch, us=ms * 1000, GBps=nbytes / ms / 1e6, max_abs_err=err,
                         ok=err < 3e-2))
    timed = sorted((r for r in rows if r.get("ok")), key=lambda r: r["us"])
    default = next(r for r in rows if r["splits"] == default_splits and all(
        r[k] == v for k, v in decode_launch(d, cache.element_size()).items()))
    print(f"batch {batch} {kv_cache_dtype}: default (splits {default_splits}, {decode_launch(d, cache.element_size())}) "
          f"{default['us']:.1f} us "
          f"{default['GBps']:.0f} GB/s", flush=True)
    for r in timed[:8]:
        print(f"   splits {r['splits']:2d} block_n {r['block_n']:3d} warps {r['num_warps']} stages "
              f"{r['num_stages']}: {r['us']:.1f} us {r['GBps']:.0f} GB/s", flush=True)
    return dict(batch=batch, kv_cache_dtype=kv_cache_dtype, context_tokens=int(lens.sum()), kv_bytes=nbytes, default_splits=default_splits,
                default=default, best=timed[:8], all=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b", help="its config gives the head shapes")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[256, 128])
    parser.add_argument("--context-range", nargs=2, type=int, default=[100, 2000])
    parser.add_argument("--max-seq-len", type=int, default=2048, help="the engine's bound (max_model_len)")
    parser.add_argument("--grid", choices=sorted(GRIDS) + ["none"], default="full",
                        help="the split kernel's launch grid ('none': only the layouts and merge-kernel timings)")
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[BLOCK], help="cache block sizes to time")
    parser.add_argument("--layouts", nargs="+", choices=["token", "head"], default=["token"],
                        help="token: blocks [block, Hk, D] (the engine's); head: [Hk, block, D]")
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8"], default=["auto"],
                        help="the cache's dtypes to sweep (auto: bf16; fp8: e4m3, scales 1)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the decode sweep needs a CUDA device")
    from throughput import write_result

    # the layouts and merge-kernel timings: asked for by their options, or alone with --grid none
    layouts = args.grid == "none" or args.block_sizes != [BLOCK] or args.layouts != ["token"]
    cfg = model_config(args.model)
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    started = time.time()
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(0), "model": args.model, "hq": hq, "hk": hk, "head_dim": d,
              "batches": [bench_batch(b, *args.context_range, hq, hk, d, args.max_seq_len, args.grid, dtype)
                          for dtype in args.kv_cache_dtype for b in args.batch_sizes] if args.grid != "none" else [],
              "layouts": {str(b): bench_layouts(b, *args.context_range, hq, hk, d, args.max_seq_len, args.block_sizes,
                                                args.layouts) for b in args.batch_sizes} if layouts else {}}
    result["seconds"] = time.time() - started
    write_result(result, args.output_json, "decode_sweep.json")


if __name__ == "__main__":
    main()
