#!/usr/bin/env python
"""GPU check of selfspec's Triton kernels, one command:

    python bench/gpu_kernels.py [--quick] [--vocab 152064] [--json out.json]

For vocab 152k, 1-64 sequences x 1-16 positions (bf16 logits; fp32 too without --quick):
  * correctness of every kernel against its torch reference (discrete outputs exactly; a
    mismatch is reported with whether the reference's own decision was a float knife edge);
  * time of the kernel (eager, and replayed from a CUDA graph where capturable), of the
    reference, and the floor: the bytes of the logit rows the verify needs, read once at the
    device's measured copy bandwidth;
  * gated LoRA: reference vs the cuBLAS path vs the Triton path per token count, and the
    TRITON_MAX_TOKENS value the measurement supports (selfspec/kernels/gated_lora_triton.py).
Prints short tables; exits non-zero if a kernel disagrees with its reference beyond knife edges.

Without CUDA it runs the CPU-reachable parts: the kernels under the Triton interpreter on small
shapes (correctness only) and the references' timings; GPU columns read n/a.
``--compile-check [--arch 90]`` compiles every kernel variant to a cubin for that GPU arch
(no GPU needed; catches what the interpreter is lenient about) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
COMPILE_CHECK = "--compile-check" in sys.argv
if not CUDA and not COMPILE_CHECK:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # the interpreter's numpy on inf - inf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from selfspec.decoding.requests import rng  # noqa: E402
from selfspec.decoding.requests.sampling import logits_to_probs  # noqa: E402
from selfspec.decoding.modes.verify import (  # noqa: E402
    greedy_verify_candidates_reference,
    greedy_verify_reference,
    speculative_verify_reference,
)
from selfspec.kernels import gated_lora_triton as glt  # noqa: E402
from selfspec.kernels import verify_triton as vt  # noqa: E402
from selfspec.kernels.gated_lora import gated_lora_linear_reference  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
FAILURES: list[str] = []
START = time.time()
BUDGET_S = [float("inf")]  # set from --budget-s: later configurations are skipped past it


def over_budget() -> bool:
    return time.time() - START > BUDGET_S[0]


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def time_us(fn, iters: int, warmup: int = 3) -> float:
    """Median wall time per call in microseconds (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    if not CUDA:
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def graph_time_us(fn, iters: int) -> float | None:
    """Time of one replay of `fn` captured in a CUDA graph (None if it cannot be captured)."""
    if not CUDA:
        return None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return time_us(graph.replay, iters)
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"    (graph capture failed: {type(exc).__name__}: {str(exc)[:80]})")
        return None


def copy_bandwidth() -> float | None:
    """Device memory bandwidth in bytes/s, measured with a large device-to-device copy."""
    if not CUDA:
        return None
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * n / (us * 1e-6)


# ----------------------------------------------------------------------------------------------
# inputs and the knife-edge check
# ----------------------------------------------------------------------------------------------


def make_inputs(gen, bsz, rows, vocab, dtype, scenario):
    logits = torch.randn(bsz, rows, vocab, generator=gen, device=DEVICE) * 3
    hot = torch.randint(0, vocab, (bsz, rows), generator=gen, device=DEVICE)
    logits.scatter_add_(-1, hot.unsqueeze(-1), torch.full((bsz, rows, 1), 12.0, device=DEVICE))
    logits = logits.to(dtype)
    depth = rows - 1
    drafts = logits[:, :depth].float().argmax(-1)
    if scenario != "accept":
        rand = torch.randint(0, vocab, (bsz, depth), generator=gen, device=DEVICE)
        drafts = torch.where(torch.rand(bsz, depth, generator=gen, device=DEVICE) < 0.7, drafts, rand)
    nd = torch.full((bsz,), depth, dtype=torch.long, device=DEVICE)
    seeds = torch.randint(0, 2**31 - 1, (bsz, rows), generator=gen, device=DEVICE)
    return logits, drafts, nd, seeds


def knife_edges(logits, drafts, nd, seeds, temp, top_k, top_p, tau, q, ref):
    """[B] bool: the reference's decision rests on a float knife edge (see tests/test_kernels_verify.py)."""
    bsz, depth = drafts.shape
    vocab = logits.shape[-1]
    probs = logits_to_probs(logits, temp, top_k, top_p)
    scaled = logits.float() / (temp if temp > 0 else 1.0)
    smax = scaled.amax(-1)
    flags = torch.zeros(bsz, dtype=torch.bool, device=DEVICE)
    if depth and temp > 0:
        p_d = probs[:, :depth].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_d = torch.ones_like(p_d) if q is None else q.float().gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        u = rng.uniform(seeds[:, :depth], torch.zeros((), dtype=torch.long, device=DEVICE))
        rhs = (1.0 + tau) * p_d
        tol = 1e-5 + 2.0**-20 * (scaled[:, :depth].gather(-1, drafts.unsqueeze(-1)).squeeze(-1).abs()
                                 + smax[:, :depth].abs())
        knife = ((u * q_d - rhs).abs() <= tol * rhs.abs()) & (rhs > 0)
        rel = torch.arange(depth, device=DEVICE).unsqueeze(0) <= ref.accept_len.unsqueeze(1)
        flags |= (knife & rel).any(1)
    if temp > 0:
        rows = torch.arange(bsz, device=DEVICE)
        j = ref.accept_len
        p_stop = probs[rows, j]
        noise = rng.gumbel(seeds[rows, j].unsqueeze(1), torch.arange(1, vocab + 1, device=DEVICE).unsqueeze(0))
        top2 = (p_stop.log() + noise).nan_to_num(neginf=-1e30).topk(2, dim=-1).values
        flags |= (top2[:, 0] - top2[:, 1]) <= 2e-5 + 2.0**-20 * 2 * smax[rows, j].abs()
    return flags


# ----------------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------------


def fmt(x, unit=""):
    return "n/a" if x is None else f"{x:.1f}{unit}"


def bench_verify(args, bandwidth):
    vocab = args.vocab if CUDA else 4096
    dtypes = [torch.bfloat16] if (args.quick or not CUDA) else [torch.bfloat16, torch.float32]
    seqs = ([1, 16, 64] if args.quick else [1, 4, 16, 64]) if CUDA else [1, 4]
    positions = ([1, 4, 16] if args.quick else [1, 2, 4, 8, 16]) if CUDA else [1, 4]  # T = drafts + 1
    scenarios = ["accept", "mixed"] if args.quick else ["accept", "mixed", "topk_topp", "dense_q", "greedy_T0"]
    if not CUDA:
        scenarios = ["accept", "mixed", "topk_topp"]
    iters = args.iters
    rows_out = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"\n== speculative verify (vocab {vocab}) ==")
    print(f"{'dtype':>5} {'B':>3} {'T':>3} {'scenario':>10} | {'ok':>9} {'knife':>5} {'slow':>4} | "
          f"{'kernel':>8} {'graph':>8} {'ref':>9} {'floor':>7} | {'k/floor':>7} {'ref/k':>6}  (us)")
    for dtype in dtypes:
        for bsz in seqs:
            for rows in positions:
                for scenario in scenarios:
                    if dtype == torch.float32 and scenario != "mixed":
                        continue
                    if over_budget():
                        print("    (time budget reached: skipping the rest of this section)")
                        return rows_out
                    logits, drafts, nd, seeds = make_inputs(gen, bsz, rows, vocab, dtype, scenario)
                    temp, top_k, top_p, tau, q = 0.8, 0, 1.0, 0.0, None
                    if scenario == "accept":
                        tau = 1e30  # every draft with p > 0 passes: the one-pass path
                    elif scenario == "topk_topp":
                        top_k, top_p = 50, 0.9
                    elif scenario == "dense_q":
                        if rows == 1:
                            continue
                        q = torch.softmax(logits[:, :-1].float() + torch.randn(
                            bsz, rows - 1, vocab, generator=gen, device=DEVICE), -1)
                    elif scenario == "greedy_T0":
                        temp = 0.0
                    ref_fn = lambda: speculative_verify_reference(  # noqa: E731
                        logits, drafts, nd, seeds, temp, top_k, top_p, tau, q)
                    stats: dict = {}
                    ker_fn = lambda: vt.speculative_verify_triton(  # noqa: E731
                        logits, drafts, nd, seeds, temp, top_k, top_p, tau, q, stats=stats)
                    ref, got = ref_fn(), ker_fn()
                    mism = (ref.accept_len != got.accept_len) | (ref.next_tokens != got.next_tokens)
                    knife = knife_edges(logits, drafts, nd, seeds, temp, top_k, top_p, tau, q, ref)
                    bad = int((mism & ~knife).sum())
                    slow = int(stats["slow_path"].sum())
                    name = f"spec {dtype} B{bsz} T{rows} {scenario}"
                    if bad and scenario != "topk_topp":
                        FAILURES.append(f"{name}: {bad} mismatches not at knife edges")
                    elif bad:  # top-p tie groups (bf16 logits) are a documented difference
                        print(f"    note: {name}: {bad} mismatches (top-p tie groups or boundary rounding?)")
                    k_us = time_us(ker_fn, iters) if CUDA else None
                    g_us = graph_time_us(ker_fn, iters) if (CUDA and scenario != "topk_topp") else None
                    r_us = time_us(ref_fn, max(3, iters // 4))
                    floor = vt.logits_floor_bytes(logits, nd) / bandwidth * 1e6 if bandwidth else None
                    best = min(x for x in (k_us, g_us) if x is not None) if k_us else None
                    ratio = best / floor if (best and floor) else None
                    speed = r_us / k_us if k_us else None
                    ok = f"{bsz - int(mism.sum())}/{bsz}"
                    print(f"{str(dtype)[6:]:>5} {bsz:>3} {rows:>3} {scenario:>10} | {ok:>9} {int(knife.sum()):>5} "
                          f"{slow:>4} | {fmt(k_us):>8} {fmt(g_us):>8} {fmt(r_us):>9} {fmt(floor):>7} | "
                          f"{fmt(ratio, 'x'):>7} {fmt(speed, 'x'):>6}")
                    rows_out.append(dict(kind="speculative", dtype=str(dtype), B=bsz, T=rows, scenario=scenario,
                                         mismatches=int(mism.sum()), unexplained=bad, knife=int(knife.sum()),
                                         slow_path=slow, kernel_us=k_us, graph_us=g_us, ref_us=r_us,
                                         floor_us=floor))
                    del logits, q
    return rows_out


def bench_greedy(args, bandwidth):
    vocab = args.vocab if CUDA else 4096
    seqs = [1, 16, 64] if CUDA else [2]
    positions = [1, 4, 16] if CUDA else [4]
    iters = args.iters
    out = []
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    print(f"\n== greedy verify / candidates (vocab {vocab}, bf16) ==")
    print(f"{'B':>3} {'C':>2} {'T':>3} | {'ok':>6} | {'kernel':>8} {'graph':>8} {'ref':>9} {'floor':>7} | {'k/floor':>7}  (us)")
    for bsz in seqs:
        for rows in positions:
            for cands in (1, 4):
                if cands > 1 and rows == 1:
                    continue
                if over_budget():
                    print("    (time budget reached: skipping the rest of this section)")
                    return out
                logits, drafts, nd, _ = make_inputs(gen, bsz * cands, rows, vocab, torch.bfloat16, "mixed")
                if cands == 1:
                    ref_fn = lambda: greedy_verify_reference(logits, drafts, nd)  # noqa: E731
                    ker_fn = lambda: vt.greedy_verify_triton(logits, drafts, nd)  # noqa: E731
                else:
                    l4 = logits.view(bsz, cands, rows, vocab)
                    d4, n4 = drafts.view(bsz, cands, rows - 1), nd.view(bsz, cands)
                    ref_fn = lambda: greedy_verify_candidates_reference(l4, d4, n4)  # noqa: E731
                    ker_fn = lambda: vt.greedy_verify_candidates_triton(l4, d4, n4)  # noqa: E731
                ref, got = ref_fn(), ker_fn()
                same = (ref.accept_len == got.accept_len) & (ref.next_tokens == got.next_tokens)
                if cands > 1:
                    same &= ref.best_candidate == got.best_candidate
                if not bool(same.all()):
                    FAILURES.append(f"greedy B{bsz} C{cands} T{rows}: {int((~same).sum())} mismatches")
                k_us = time_us(ker_fn, iters) if CUDA else None
                g_us = graph_time_us(ker_fn, iters) if CUDA else None
                r_us = time_us(ref_fn, max(3, iters // 4))
                floor = vt.logits_floor_bytes(logits, nd) / bandwidth * 1e6 if bandwidth else None
                best = min(x for x in (k_us, g_us) if x is not None) if k_us else None
                print(f"{bsz:>3} {cands:>2} {rows:>3} | {int(same.sum()):>3}/{bsz:<2} | {fmt(k_us):>8} {fmt(g_us):>8} "
                      f"{fmt(r_us):>9} {fmt(floor):>7} | {fmt(best / floor if best and floor else None, 'x'):>7}")
                out.append(dict(kind="greedy", B=bsz, C=cands, T=rows, ok=bool(same.all()), kernel_us=k_us,
                                graph_us=g_us, ref_us=r_us, floor_us=floor))
    return out


def bench_lora(args):
    hidden, out_f, rank = (4096, 4096, 128) if CUDA else (256, 192, 32)
    tokens_list = ([1, 4, 16, 64, 256] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]) if CUDA else [1, 9]
    iters = args.iters
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    dtype = torch.bfloat16
    w = (torch.randn(out_f, hidden, generator=gen, device=DEVICE) / hidden**0.5).to(dtype)
    a = (torch.randn(rank, hidden, generator=gen, device=DEVICE) / hidden**0.5).to(dtype)
    b = (torch.randn(out_f, rank, generator=gen, device=DEVICE) / rank**0.5).to(dtype)
    print(f"\n== gated LoRA (in {hidden}, out {out_f}, rank {rank}, bf16, half the tokens gated) ==")
    print(f"{'tokens':>6} | {'off-rows exact':>14} {'max|tri-ref|':>12} | {'ref':>8} {'cublas':>8} {'triton':>8} "
          f"{'cublas(g)':>9} {'triton(g)':>9}  (us)")
    out = []
    for tokens in tokens_list:
        if over_budget():
            print("    (time budget reached: skipping the rest of this section)")
            break
        x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(dtype)
        mask = (torch.arange(tokens, device=DEVICE) % 2 == 1).long()
        ref = gated_lora_linear_reference(x, w, None, a, b, 2.0, mask)
        cub = glt.gated_lora_linear_cublas(x, w, None, a, b, 2.0, mask)
        tri = glt.gated_lora_linear_triton(x, w, None, a, b, 2.0, mask)
        off = ~mask.bool()
        exact = bool(torch.equal(cub, ref)) and bool(torch.equal(tri[off], ref[off]))
        diff = (tri.float() - ref.float()).abs().max().item()
        if not exact:
            FAILURES.append(f"lora tokens {tokens}: gated-off rows differ from the base")
        r_us = time_us(lambda: gated_lora_linear_reference(x, w, None, a, b, 2.0, mask), iters)
        c_us = time_us(lambda: glt.gated_lora_linear_cublas(x, w, None, a, b, 2.0, mask), iters) if CUDA else None
        t_us = time_us(lambda: glt.gated_lora_linear_triton(x, w, None, a, b, 2.0, mask), iters) if CUDA else None
        cg = graph_time_us(lambda: glt.gated_lora_linear_cublas(x, w, None, a, b, 2.0, mask), iters)
        tg = graph_time_us(lambda: glt.gated_lora_linear_triton(x, w, None, a, b, 2.0, mask), iters)
        print(f"{tokens:>6} | {str(exact):>14} {diff:>12.3g} | {fmt(r_us):>8} {fmt(c_us):>8} {fmt(t_us):>8} "
              f"{fmt(cg):>9} {fmt(tg):>9}")
        out.append(dict(kind="lora", tokens=tokens, exact_off_rows=exact, max_diff=diff, ref_us=r_us,
                        cublas_us=c_us, triton_us=t_us, cublas_graph_us=cg, triton_graph_us=tg))
    if CUDA:
        limit = 0
        for row in out:  # largest prefix of token counts where Triton wins (graph replay when available)
            c = row["cublas_graph_us"] or row["cublas_us"]
            t = row["triton_graph_us"] or row["triton_us"]
            if t < c:
                limit = row["tokens"]
            else:
                break
        print(f"-> measured: TRITON_MAX_TOKENS = {limit} "
              f"({'cuBLAS at every token count' if limit == 0 else f'Triton up to {limit} tokens, cuBLAS above'}); "
              f"current setting {glt.TRITON_MAX_TOKENS}")
    return out


def sweep_blocks(args):
    """Launch-geometry sweep for the speculative pass (not with --quick)."""
    vocab = args.vocab
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    print("\n== verify launch geometry sweep (bf16, mixed) ==")
    for bsz, rows in ((1, 4), (16, 8), (64, 16)):
        logits, drafts, nd, seeds = make_inputs(gen, bsz, rows, vocab, torch.bfloat16, "mixed")
        line = []
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8)):
            us = time_us(lambda: vt.speculative_verify_triton(logits, drafts, nd, seeds, 0.8, block_v=block,
                                                              num_warps=warps), args.iters)
            line.append(f"{block}/{warps}: {us:.1f}")
        print(f"B{bsz:>3} T{rows:>3}  " + "  ".join(line))


def compile_check(arch: int) -> int:
    """Compile every kernel variant for `arch` through Triton's full pipeline (ptxas included)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    if vt.INTERPRETED:
        print("TRITON_INTERPRET=1 is set: unset it for --compile-check")
        return 2
    target = GPUTarget("cuda", arch, 32)
    ptr = {  # argument name -> pointer type (everything else: i32, floats listed below)
        "seeds": "*i64", "nd_ptr": "*i64", "drafts": "*i64", "temp_ptr": "*fp32", "tau_ptr": "*fp32",
        "thr_ptr": "*fp32", "pm": "*fp32", "ps": "*fp32", "pidx": "*i32", "pbs": "*fp32", "pbg": "*fp32",
        "pflag": "*i32", "out_len": "*i64", "out_next": "*i64", "out_tok": "*i64", "out_best": "*i64",
        "need": "*i32", "st_m": "*fp32", "st_s": "*fp32", "st_i": "*i32", "r_nan": "*i32", "r_best": "*fp32",
        "r_idx": "*i32", "p_nan": "*i32", "p_best": "*fp32", "p_idx": "*i32", "pos": "*i32", "mask": "*i32",
    }
    variants = []
    for dt in ("bf16", "fp32"):
        for hf in (False, True):
            variants.append((vt._spec_pass1, {"logits": f"*{dt}"}, dict(HAS_FILTER=hf, BLOCK=2048)))
            for hq in (False, True):
                for ho in (False, True):
                    variants.append((vt._spec_decide, {"logits": f"*{dt}", "q_ptr": "*fp32"},
                                     dict(HAS_FILTER=hf, HAS_Q=hq, HAS_OUT_TOK=ho, BLOCK_D=16, BLOCK_NS=64)))
                variants.append((vt._spec_pass2, {"logits": f"*{dt}", "q_ptr": "*bf16"},
                                 dict(HAS_FILTER=hf, HAS_Q=hq, BLOCK=2048)))
        variants.append((vt._argmax_pass, {"logits": f"*{dt}"}, dict(BLOCK=2048)))
        prec = "ieee" if dt == "fp32" else "tf32"
        lora = {"x": f"*{dt}", "w": f"*{dt}", "t": f"*{dt}", "y": f"*{dt}"}
        variants.append((glt._lora_shrink, lora, dict(BM=16, BK=128, BR=64, PRECISION=prec, UPCAST=False)))
        variants.append((glt._lora_expand, lora, dict(BM=16, BN=128, BR=64, PRECISION=prec, UPCAST=False)))
    for ho in (False, True):
        variants.append((vt._spec_finalize, {}, dict(HAS_OUT_TOK=ho, BLOCK_NS=64)))
        variants.append((vt._greedy_combine, {}, dict(HAS_BEST=ho, HAS_OUT_TOK=ho, BLOCK_D=16, BLOCK_NS=64)))
    failures = 0
    for fn, extra, consts in variants:
        consts = dict(consts)
        for flag, arg in (("HAS_FILTER", "thr_ptr"), ("HAS_Q", "q_ptr"), ("HAS_OUT_TOK", "out_tok"),
                          ("HAS_BEST", "out_best")):
            if consts.get(flag) is False:
                consts[arg] = None
        types = {**ptr, **extra}
        sig = {n: "constexpr" if n in consts else types.get(n, "fp32" if n == "scaling" else "i32")
               for n in fn.arg_names}
        name = f"{fn.__name__} {extra.get('logits', extra.get('x', ''))} " + " ".join(
            f"{k}={v}" for k, v in consts.items() if k.isupper())
        t0 = time.time()
        try:
            kernel = triton_compile(ASTSource(fn, sig, constexprs=consts), target=target, options={"num_warps": 4})
            print(f"ok   {name}  ({time.time() - t0:.1f}s, {len(kernel.asm['cubin'])} B cubin)")
        except Exception as exc:  # noqa: BLE001
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:400]}")
    print(f"{len(variants) - failures}/{len(variants)} kernel variants compile for sm_{arch}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller sweep (a few minutes at most)")
    parser.add_argument("--vocab", type=int, default=152064, help="vocabulary size on GPU (Qwen: 152064)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per measurement")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the results here (default: $OUT/gpu_kernels.json when $OUT is set)")
    parser.add_argument("--compile-check", action="store_true",
                        help="only compile every kernel variant for --arch (no GPU needed) and exit")
    parser.add_argument("--arch", type=int, default=90, help="GPU arch for --compile-check (H100/H200: 90)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip remaining configurations after this many seconds (default 420 quick, 900 full)")
    args = parser.parse_args()
    if args.compile_check:
        return compile_check(args.arch)
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "gpu_kernels.json"
    BUDGET_S[0] = args.budget_s if args.budget_s is not None else (420.0 if args.quick else 900.0)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    if args.iters is None:
        args.iters = (10 if args.quick else 30) if CUDA else 2
    t0 = time.time()
    if CUDA:
        props = torch.cuda.get_device_properties(DEVICE)
        bandwidth = copy_bandwidth()
        print(f"device: {props.name}, {props.multi_processor_count} SMs, "
              f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (floor = needed logit bytes / this)")
    else:
        bandwidth = None
        print("device: CPU only -- kernels run in the Triton interpreter on small shapes (correctness only); "
              "GPU timings and the bandwidth floor are n/a; 'ref' is the torch reference on this CPU")
    results = {"verify": bench_verify(args, bandwidth), "greedy": bench_greedy(args, bandwidth),
               "lora": bench_lora(args)}
    if CUDA and not args.quick and not over_budget():
        sweep_blocks(args)
    print(f"\nelapsed {time.time() - t0:.0f}s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if FAILURES:
        print("FAILURES:\n  " + "\n  ".join(FAILURES))
        return 1
    print("all kernels agree with their references (up to reported knife edges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
