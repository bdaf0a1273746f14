"""The pure-torch `sgl_kernel` stand-ins against SGLang's own Triton references, and their activation.

The Triton references run on CPU under the Triton interpreter. They are loaded from SGLang's
source files as private module copies (so `@triton.jit` is applied with TRITON_INTERPRET=1 set,
whatever else this pytest process imported before), with a placeholder `sgl_kernel` present only
while a copy executes its module-level imports.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (or any SGLang kernel module) is imported

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("sglang")
pytest.importorskip("triton")

from selfspec.sglang_ext.cpu_compat import SHIM_ROOT, ops  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------
# loading SGLang's references


@contextlib.contextmanager
def _placeholder_sgl_kernel():
    """Let a module-level `from sgl_kernel[.speculative] import x` succeed while a reference loads."""
    saved = {k: sys.modules.get(k) for k in ("sgl_kernel", "sgl_kernel.speculative")}
    if saved["sgl_kernel"] is None:
        stub = types.ModuleType("sgl_kernel")
        stub.__path__ = []
        stub.__getattr__ = lambda name: None  # type: ignore[method-assign]
        spec_stub = types.ModuleType("sgl_kernel.speculative")
        spec_stub.__getattr__ = lambda name: None  # type: ignore[method-assign]
        stub.speculative = spec_stub
        sys.modules["sgl_kernel"] = stub
        sys.modules["sgl_kernel.speculative"] = spec_stub
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _reference(modname: str) -> types.ModuleType:
    origin = importlib.util.find_spec(modname).origin
    spec = importlib.util.spec_from_file_location("_selfspec_ref_" + modname.replace(".", "_"), origin)
    mod = importlib.util.module_from_spec(spec)
    with _placeholder_sgl_kernel():
        spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ref():
    mods = {
        "alloc": "sglang.srt.mem_cache.allocation",
        "cache_locs": "sglang.kernels.ops.speculative.cache_locs",
        "cache_move": "sglang.kernels.ops.kvcache.cache_move",
        "eagle": "sglang.kernels.ops.speculative.eagle",
        "spec_tree": "sglang.kernels.ops.speculative.spec_tree",
        "recon": "sglang.kernels.ops.speculative.reconstruct_tree",
        "mle": "sglang.kernels.ops.speculative.multi_layer_eagle",
        "murmur": "sglang.kernels.ops.sampling.murmur_hash",
    }
    return types.SimpleNamespace(**{k: _reference(v) for k, v in mods.items()})


def _p2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _ragged(g: torch.Generator, bs: int, pool_len: int, max_len: int):
    """Distinct request rows plus [start, end) windows inside pool_len."""
    lens = torch.randint(0, max_len + 1, (bs,), generator=g)
    start = torch.stack([torch.randint(0, pool_len - int(n) + 1, (1,), generator=g)[0] for n in lens])
    return start, start + lens


# ------------------------------------------------------------------------------------------
# KV-slot bookkeeping


@pytest.mark.parametrize("bs,max_len", [(1, 5), (3, 40), (7, 70)])
def test_assign_req_to_token_pool(ref, bs, max_len):
    g = torch.Generator().manual_seed(bs)
    pool_rows, pool_len = 12, 96
    table = torch.randint(0, 10_000, (pool_rows, pool_len), generator=g, dtype=torch.int32)
    rpi = torch.randperm(pool_rows, generator=g)[:bs]
    start, end = _ragged(g, bs, pool_len, max_len)
    total = int((end - start).sum())
    out_cache_loc = torch.randint(0, 1 << 20, (total + 3,), generator=g)

    expect = table.clone()
    ref.alloc.assign_req_to_token_pool[(bs,)](rpi, expect, start, end, out_cache_loc, pool_len, _p2(bs))
    got = table.clone()
    ops.assign_req_to_token_pool_cpu(rpi, got, start, end, out_cache_loc, pool_len)
    assert torch.equal(got, expect)
    assert not torch.equal(got, table) or total == 0


@pytest.mark.parametrize("bs,max_len", [(1, 9), (4, 33), (6, 64)])
def test_assign_extend_cache_locs(ref, bs, max_len):
    g = torch.Generator().manual_seed(100 + bs)
    pool_rows, pool_len = 10, 80
    table = torch.randint(0, 1 << 20, (pool_rows, pool_len), generator=g, dtype=torch.int32)
    rpi = torch.randperm(pool_rows, generator=g)[:bs]
    start, end = _ragged(g, bs, pool_len, max_len)
    total = int((end - start).sum())

    expect = torch.full((total + 4,), -7, dtype=torch.int64)
    ref.cache_locs.assign_extend_cache_locs[(bs,)](rpi, table, start, end, expect, pool_len, _p2(bs))
    got = torch.full((total + 4,), -7, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rpi, table, start, end, got, pool_len)
    assert torch.equal(got, expect)


def test_assign_extend_cache_locs_front_window(ref):
    # fill_front_out_cache_loc_func's use: rows = arange(bs), table = the int32 verify windows.
    g = torch.Generator().manual_seed(7)
    bs, width = 5, 6
    window = torch.randint(0, 1 << 20, (bs, width), generator=g)
    num_front = torch.randint(1, width + 1, (bs,), generator=g)
    rows, starts = torch.arange(bs), torch.zeros(bs, dtype=torch.int64)
    expect = torch.zeros(bs * width, dtype=torch.int64)
    ref.cache_locs.assign_extend_cache_locs[(bs,)](rows, window.int(), starts, num_front, expect, width, _p2(bs))
    got = torch.zeros(bs * width, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rows, window.int(), starts, num_front, got, width)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("bs,topk,steps", [(1, 1, 3), (3, 4, 2), (5, 2, 5)])
def test_assign_draft_cache_locs_contiguous(ref, bs, topk, steps):
    g = torch.Generator().manual_seed(200 + bs)
    pool_rows, pool_len = 8, 64
    width = topk * steps
    table = torch.randint(0, 1 << 20, (pool_rows, pool_len), generator=g, dtype=torch.int32)
    rpi = torch.randperm(pool_rows, generator=g)[:bs]
    seq_lens = torch.randint(0, pool_len - width + 1, (bs,), generator=g)
    expect = torch.full((bs * width + 5,), -1, dtype=torch.int64)
    ref.cache_locs.assign_draft_cache_locs_contiguous[(bs,)](rpi, table, seq_lens, expect, pool_len, topk, steps)
    got = torch.full((bs * width + 5,), -1, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rpi, table, seq_lens, got, pool_len, topk, steps)
    assert torch.equal(got, expect)


# ------------------------------------------------------------------------------------------
# KV-cache row moves


def _kv_buffers(g: torch.Generator, rows: int):
    # Two "layers" x (K, V) with different dtypes and row widths, like an MHA pool's k/v buffers.
    shapes = [
        ((rows, 2, 8), torch.bfloat16),
        ((rows, 2, 8), torch.bfloat16),
        ((rows, 3, 4), torch.float32),
        ((rows, 1, 6), torch.float16),
    ]
    return [torch.randn(s, generator=g).to(dt) for s, dt in shapes]


def _ptrs_strides(bufs):
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    return ptrs, strides


@pytest.mark.parametrize("n,overlap", [(1, False), (6, False), (9, True)])
def test_copy_all_layer_kv_cache(ref, n, overlap):
    g = torch.Generator().manual_seed(300 + n)
    rows = 40
    perm = torch.randperm(rows, generator=g)
    tgt = perm[:n]
    # overlap: sources include other targets, as when accepted KV slides to the window front
    src = perm[1 : n + 1] if overlap else perm[n : 2 * n]
    base = _kv_buffers(g, rows)

    expect = [b.clone() for b in base]
    ptrs, strides = _ptrs_strides(expect)
    # The interpreter follows the raw addresses in data_ptrs like the GPU kernel does.
    ref.cache_move.copy_all_layer_kv_cache_tiled[(len(expect), 1)](
        ptrs.to(torch.int64), strides, tgt, src, n, _p2(n), BYTES_PER_TILE=64
    )

    got = [b.clone() for b in base]
    ptrs, strides = _ptrs_strides(got)
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for e, o, b in zip(expect, got, base):
        assert torch.equal(o.view(torch.uint8), e.view(torch.uint8))
        assert torch.equal(o[tgt], b[src])  # the behaviour that matters: target rows hold the old source rows


# ------------------------------------------------------------------------------------------
# speculative commit helpers


@pytest.mark.parametrize("bs,stride", [(1, 1), (4, 5), (9, 8)])
def test_fill_bonus_tokens(ref, bs, stride):
    g = torch.Generator().manual_seed(400 + bs)
    accept_tokens = torch.randint(0, 50_000, (bs, stride), generator=g)
    accept_lens = torch.randint(1, stride + 1, (bs,), generator=g, dtype=torch.int32)
    expect = torch.empty(bs, dtype=torch.int32)
    ref.eagle.fill_bonus_tokens[(bs,)](accept_tokens, accept_lens, expect, stride)
    got = torch.empty(bs, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, got, stride)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("bs,width", [(1, 4), (3, 6), (8, 3)])
def test_fill_accept_out_cache_loc(ref, bs, width):
    g = torch.Generator().manual_seed(500 + bs)
    window = bs * width
    out_cache_loc = torch.randperm(1000, generator=g)[:window]
    accept_index = torch.full((bs, width), -1, dtype=torch.int32)
    for b in range(bs):  # accepted nodes of request b: a prefix of its row, indices into its window
        k = int(torch.randint(1, width + 1, (1,), generator=g))
        accept_index[b, :k] = (b * width + torch.randperm(width, generator=g)[:k]).int()
    size = accept_index.numel()
    expect = torch.zeros(size, dtype=torch.int64)
    ref.eagle.fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, expect, _p2(size))
    got = torch.zeros(size, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    assert torch.equal(got, expect)
    kept = accept_index[accept_index != -1].long()
    assert torch.equal(got[: kept.numel()], out_cache_loc[kept])


# ------------------------------------------------------------------------------------------
# draft trees


def _random_tree_masks(g: torch.Generator, bs: int, n: int, chain: bool = False) -> torch.Tensor:
    """bs x n x n ancestor-or-self masks of random trees rooted at node 0 (nodes in topological order)."""
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        mask[b, 0, 0] = True
        for i in range(1, n):
            p = i - 1 if chain else int(torch.randint(0, i, (1,), generator=g))
            mask[b, i] = mask[b, p]
            mask[b, i, i] = True
    return mask


def _recon_outputs(bs: int, n: int):
    return (
        torch.empty(bs * n, dtype=torch.int64),
        torch.empty(bs, n, dtype=torch.int64),
        torch.empty(bs, n, dtype=torch.int64),
        torch.empty(bs, n, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "bs,n,kind", [(1, 1, "tree"), (2, 8, "chain"), (4, 8, "tree"), (3, 12, "uint8"), (2, 6, "noise")]
)
def test_reconstruct_indices_from_tree_mask(ref, bs, n, kind):
    g = torch.Generator().manual_seed(600 + bs * n)
    if kind == "noise":  # arbitrary bits: the op's formulas are defined for any mask
        mask = torch.rand(bs, n, n, generator=g) < 0.5
    else:
        mask = _random_tree_masks(g, bs, n, chain=kind == "chain")
    flat = mask.reshape(-1).to(torch.uint8 if kind == "uint8" else torch.bool)
    seq = torch.randint(0, 500, (bs,), generator=g)
    expect = _recon_outputs(bs, n)
    ref.recon.reconstruct_indices_from_tree_mask_triton(flat, seq, *expect, bs, n)
    got = _recon_outputs(bs, n)
    ops.reconstruct_indices_from_tree_mask(flat, seq, *got, bs, n)
    for e, o in zip(expect, got):
        assert torch.equal(o, e)
    if kind == "chain":  # a chain: positions count up, each node's child is the next one
        assert torch.equal(got[0].view(bs, n) - seq[:, None], torch.arange(n).expand(bs, n))
        assert got[2][0].tolist() == list(range(1, n)) + [-1]


@pytest.mark.parametrize("bs,n,vocab", [(1, 4, 2), (3, 8, 3), (6, 10, 2)])
def test_verify_tree_greedy(ref, bs, n, vocab):
    g = torch.Generator().manual_seed(700 + bs)
    mask = _random_tree_masks(g, bs, n)
    pos, r_index, r_next, r_sib = _recon_outputs(bs, n)
    seq0 = torch.zeros(bs, dtype=torch.int64)
    ops.reconstruct_indices_from_tree_mask(mask.reshape(-1), seq0, pos, r_index, r_next, r_sib, bs, n)
    # A tiny vocabulary so that many drafts match and walks go deep.
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    target = torch.randint(0, vocab, (bs, n), generator=g)
    depth = int((pos.view(bs, n)).max()) + 1

    def run(fn):
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, depth), -1, dtype=torch.int32)
        accept_num = torch.empty(bs, dtype=torch.int32)
        fn(predicts, accept_index, accept_num, candidates, r_index, r_next, r_sib, target)
        return predicts, accept_index, accept_num

    expect = run(ref.spec_tree.verify_tree_greedy_triton)
    got = run(
        lambda p, a, k, c, ri, rn, rs, t: ops.verify_tree_greedy_cpu(
            predicts=p, accept_index=a, accept_token_num=k, candidates=c,
            retrive_index=ri, retrive_next_token=rn, retrive_next_sibling=rs, target_predict=t,
        )
    )
    for e, o in zip(expect, got):
        assert torch.equal(o, e)
    assert int(got[2].max()) > 0  # some drafts were accepted: the walk was exercised


def _eagle_draft(g: torch.Generator, bs: int, topk: int, steps: int, n: int):
    """parent_list / selected index as SGLang's EAGLE draft loop builds them (eagle_utils.organize_draft_results)."""
    p0 = torch.rand(bs, topk, generator=g) * 0.9 + 0.05
    score_list = [p0.unsqueeze(1)]
    parents = [torch.arange(-1, topk).expand(bs, -1)]
    scores = p0
    for i in range(1, steps):
        expand = scores.unsqueeze(2) * (torch.rand(bs, topk, topk, generator=g) * 0.9 + 0.05)
        cs_p, cs_idx = torch.topk(expand.flatten(1), topk, dim=-1)
        score_list.append(expand)
        parents.append(cs_idx + topk * topk * (i - 1) + topk)
        scores = cs_p
    flat_scores = torch.cat(score_list, dim=1).flatten(1)
    selected = torch.sort(torch.topk(flat_scores, n - 1, dim=-1).indices).values
    parent_list = torch.cat(parents[:-1], dim=1) if steps > 1 else torch.empty(bs, 0, dtype=torch.long)
    return parent_list.contiguous(), selected.contiguous()


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bs,topk,steps,n", [(1, 1, 3, 4), (2, 4, 3, 8), (3, 2, 4, 6)])
def test_build_tree_kernel_efficient(ref, mode, bs, topk, steps, n):
    g = torch.Generator().manual_seed(800 + bs * 10 + topk)
    parent_list, selected = _eagle_draft(g, bs, topk, steps, n)
    seq = torch.randint(1, 9, (bs,), generator=g)
    mask_len = int(seq.sum()) * n + n * n * bs if mode == 0 else n * n * bs

    def run(fn):
        tree_mask = torch.ones(mask_len, dtype=torch.bool)
        positions = torch.empty(bs * n, dtype=torch.long)
        retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
        fn(parent_list, selected, seq, tree_mask, positions, *retrieve, topk, steps, n, mode)
        return tree_mask, positions, retrieve

    expect = run(ref.spec_tree.sgl_build_tree_kernel_triton)
    got = run(ops.build_tree_kernel_efficient_cpu)
    for e, o in zip(expect, got):
        assert torch.equal(o, e)
    if mode == 1:  # every draft row sees the root and itself
        blk = got[0].view(bs, n, n)
        assert blk[:, :, 0].all() and torch.diagonal(blk, dim1=1, dim2=2).all()


# ------------------------------------------------------------------------------------------
# multi-layer EAGLE rotation, seeded-sampling hash


@pytest.mark.parametrize("lens,with_select", [([3], False), ([1, 4, 0, 7], False), ([2, 5, 3], True)])
def test_rotate_input_ids(ref, lens, with_select):
    g = torch.Generator().manual_seed(900 + len(lens))
    seq_lens = torch.tensor(lens)
    start = torch.cumsum(seq_lens, 0) - seq_lens
    ids = torch.randint(0, 1000, (int(seq_lens.sum()) + 2,), generator=g)
    new = torch.randint(1000, 2000, (len(lens), 1), generator=g)
    select = (start + torch.clamp(seq_lens - 2, min=0)) if with_select else None
    expect = ids.clone()
    ref.mle.rotate_input_ids_kernel[(len(lens),)](expect, start, seq_lens, new, select, BLOCK_SIZE=8)
    got = ids.clone()
    ops.rotate_input_ids_cpu(got, start, seq_lens, new, select)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("n,m", [(1, 7), (5, 300)])
def test_murmur_hash32(ref, n, m):
    g = torch.Generator().manual_seed(n)
    seed = torch.randint(0, 1 << 62, (n,), generator=g)
    seed[0] = (1 << 63) - 5  # high half set
    positions = torch.randint(0, 1 << 31, (n,), generator=g)
    cols = torch.arange(m)
    expect = torch.empty((n, m), dtype=torch.uint32)
    kernel = ref.murmur.murmur_hash32_kernel
    kernel[(n, 1)](seed.to(torch.uint64), positions, cols, expect, n, m, BLOCK_SIZE=_p2(m))
    got = ops.murmur_hash32_cpu(seed.to(torch.uint64), positions, cols)
    assert got.dtype == torch.uint32
    assert torch.equal(got.view(torch.int32), expect.view(torch.int32))


# ------------------------------------------------------------------------------------------
# activation (subprocesses: sys.modules / sys.path state must start clean)


def _run(code: str, tmp_path: Path, *, cpu_engine: bool = True, extra_path: Path | None = None) -> dict:
    drop = ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH", "TRITON_INTERPRET", "SELFSPEC_CPU_COMPAT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_PROBE = """
import json, sys
from selfspec.sglang_ext.cpu_compat import SHIM_ROOT, install_cpu_compat, is_shim_active
ret = install_cpu_compat()
import sgl_kernel
print(json.dumps({"ret": ret, "shim": is_shim_active(), "file": sgl_kernel.__file__,
                  "on_path": str(SHIM_ROOT) in sys.path,
                  "front": sys.path[0] == str(SHIM_ROOT)}))
"""


def test_not_installed_when_real_sgl_kernel_imports(tmp_path):
    fake = tmp_path / "site"
    (fake / "sgl_kernel").mkdir(parents=True)
    (fake / "sgl_kernel" / "__init__.py").write_text("REAL = True\n")
    out = _run(_PROBE, tmp_path, extra_path=fake)
    assert out["ret"] is False and out["shim"] is False and out["on_path"] is False
    assert out["file"] == str(fake / "sgl_kernel" / "__init__.py")


def test_shadows_a_broken_sgl_kernel(tmp_path):
    # The PyPI CUDA wheel on a CPU box fails inside its __init__ (libcuda.so.1 missing).
    fake = tmp_path / "site"
    (fake / "sgl_kernel").mkdir(parents=True)
    (fake / "sgl_kernel" / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    out = _run(_PROBE, tmp_path, extra_path=fake)
    assert out["ret"] is True and out["shim"] is True and out["front"] is True
    assert out["file"] == str(SHIM_ROOT / "sgl_kernel" / "__init__.py")


def test_inactive_without_cpu_engine(tmp_path):
    code = """
    import json, sys
    from selfspec.sglang_ext.cpu_compat import SHIM_ROOT, install_cpu_compat
    print(json.dumps({"ret": install_cpu_compat(), "on_path": str(SHIM_ROOT) in sys.path,
                      "loaded": "sgl_kernel" in sys.modules}))
    """
    assert _run(code, tmp_path, cpu_engine=False) == {"ret": False, "on_path": False, "loaded": False}


def test_spawned_child_imports_shim_before_any_code_runs(tmp_path):
    # Like SGLang's scheduler: the spawn child's target lives in a module that imports sgl_kernel
    # at module level, so the import happens while the child unpickles its target, before the
    # target (where SGLang calls load_plugins) runs. Only the parent ran install_cpu_compat().
    (tmp_path / "needs_kernel.py").write_text(
        "from sgl_kernel import assign_req_to_token_pool_cpu\n"
        "from sgl_kernel.speculative import reconstruct_indices_from_tree_mask\n"
        "def child(q):\n"
        "    import sgl_kernel\n"
        "    q.put(bool(getattr(sgl_kernel, '__selfspec_cpu_shim__', False)))\n"
    )
    code = """
    import json, multiprocessing as mp, sys
    sys.path.insert(0, ".")
    from selfspec.sglang_ext.cpu_compat import install_cpu_compat
    if __name__ == "__main__":
        assert install_cpu_compat()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        import needs_kernel
        p = ctx.Process(target=needs_kernel.child, args=(q,))
        p.start(); got = q.get(timeout=60); p.join(60)
        print(json.dumps({"child_shim": got, "exitcode": p.exitcode}))
    """
    assert _run(code, tmp_path) == {"child_shim": True, "exitcode": 0}


def test_sglang_cpu_modules_bind_the_stand_ins(tmp_path):
    # What SGLang's CPU engine imports at module level resolves to these functions, and the
    # seeded-sampling hash reaches the registered torch op.
    code = """
    import json
    from selfspec.sglang_ext.cpu_compat import install_cpu_compat, ops
    assert install_cpu_compat()
    import torch
    from sglang.srt.mem_cache import allocation
    from sglang.kernels.ops.kvcache import cache_move
    from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree, reconstruct_tree
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32
    bound = {
        "alloc": allocation.assign_req_to_token_pool_cpu is ops.assign_req_to_token_pool_cpu,
        "move": cache_move.copy_all_layer_kv_cache_cpu is ops.copy_all_layer_kv_cache_cpu,
        "extend": cache_locs.assign_extend_cache_locs_cpu is ops.assign_extend_cache_locs_cpu,
        "draft": cache_locs.assign_draft_cache_locs_contiguous_cpu is ops.assign_draft_cache_locs_contiguous_cpu,
        "bonus": eagle.fill_bonus_tokens_cpu is ops.fill_bonus_tokens_cpu,
        "accept": eagle.fill_accept_out_cache_loc_cpu is ops.fill_accept_out_cache_loc_cpu,
        "verify": spec_tree.sgl_verify_tree_greedy_cpu is ops.verify_tree_greedy_cpu,
        "build": spec_tree.sgl_build_tree_kernel_efficient_cpu is ops.build_tree_kernel_efficient_cpu,
        "recon": reconstruct_tree.reconstruct_indices_from_tree_mask is ops.reconstruct_indices_from_tree_mask,
    }
    seed = torch.tensor([3, 2**40 + 1], dtype=torch.uint64)
    pos, cols = torch.tensor([5, 9]), torch.arange(17)
    bound["murmur"] = torch.equal(murmur_hash32(seed, pos, cols), ops.murmur_hash32_cpu(seed, pos, cols))
    print(json.dumps(bound))
    """
    out = _run(code, tmp_path)
    assert all(out.values()), out
