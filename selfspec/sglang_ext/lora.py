"""RISD: per-token gated LoRA inside SGLang's own linear layers.

An RISD forward must give the verify positions exactly the base model (so their logits are the
AR distribution and their KV is the base model's KV), and the [MASK] positions base + LoRA.
SGLang fuses the HF projections (q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`), so a PEFT
adapter is mapped onto the fused layers: the LoRA A matrices of the fused parts are stacked
and their B matrices placed block-diagonally (scaling folded in), which gives each part's delta
on its own output slice and exact zeros elsewhere.

Installation (no patched files): the plugin registers AROUND hooks on SGLang's
`UnquantizedLinearMethod.apply` / `apply_into` and `UnquantizedEmbeddingMethod.embedding`; the
worker attaches the adapter tensors to the target layers (`attach_to_sglang_model`) and sets the
per-forward mask on the model's one `LoRAGate` (`selfspec.kernels.lora_gate`; mask [bs, W] bool,
True at MASK positions). A layer
without an adapter, or a forward without a gate (prefill, other modes), runs the original
method untouched. With a gate, the output is the original method's output plus the LoRA delta
at the gated rows (`selfspec.kernels.gated_lora.add_gated_lora`): gated-off rows are the
original output bit for bit on every device, and the base projection runs once. On CUDA every
op is shape-static, so the path can be captured in SGLang's target-verify CUDA graph (the gate
then copies each mask into its persistent buffer); on CPU the delta is computed on the gated rows only.

Supported adapter contents: LoRA on q/k/v/o/gate/up/down projections, and PEFT embedding
updates of `embed_tokens` (`trainable_token_indices` rows, or `modules_to_save`), used at gated
tokens only. Not supported (refused at startup): LoRA on lm_head / embeddings, DoRA.

Tensor parallelism (`--tp-size > 1`) shards the adapter the way SGLang's own TP LoRA layers do
(`sglang/srt/lora/layers.py` `slice_lora_a_weights` / `slice_lora_b_weights`), written out in
`shard_lora`: a column-parallel layer keeps the rows of B that produce its output shard (each
fused part q / k / v or gate / up on its own, k / v by the rank's KV-head shard with replicated
KV heads), A whole; a row-parallel layer keeps A's columns of its input shard and B whole, so
each rank adds B·(A_r x_r) to its partial output before SGLang's all-reduce sums them into
B·A·x. Embedding updates keep the rows of the rank's vocabulary shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.kernels.gated_lora import add_gated_lora
from selfspec.kernels.lora_gate import LoRAGate, model_gate, set_model_gate

_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LoRAAttachError(ValueError):
    pass


@dataclass
class LayerLoRA:
    lora_a: torch.Tensor  # [r_total, in]
    lora_b: torch.Tensor  # [out, r_total], scaling folded in
    gate: LoRAGate  # the model's gate (the hooks are global; the layer says which gate it follows)


@dataclass
class EmbeddingUpdate:
    weight: torch.Tensor  # [vocab, hidden] adapted table (used at gated tokens only)
    gate: LoRAGate


class GatedLoRAHandle:
    """What the worker keeps: the attached layers (for logging) and the model's gate."""

    def __init__(self, layers: dict[str, LayerLoRA], embeddings: dict[str, EmbeddingUpdate], adapter: str,
                 gate: LoRAGate):
        self.layers = layers
        self.embeddings = embeddings
        self.adapter = adapter
        self.gate = gate

    def __repr__(self) -> str:
        return f"GatedLoRAHandle({self.adapter}: {len(self.layers)} layers, {len(self.embeddings)} embeddings)"


def _capture_around(original, self, size, *args, **kwargs):
    """While SGLang captures a target-verify CUDA graph of `size` requests, the LoRA hooks read
    their gate from the gate's persistent buffer, so the gated path is part of the graph."""
    gate = model_gate(self.model_runner.model)
    if gate is None:
        return original(self, size, *args, **kwargs)
    with gate.capture(int(size) * int(getattr(self, "captured_req_width", 1) or 1)):
        return original(self, size, *args, **kwargs)


# ------------------------------------------------------------------------------ the hooks
def _gated_output(lora: LayerLoRA, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    mask = lora.gate.mask.reshape(-1)
    flat_x = x.reshape(-1, x.shape[-1])
    if mask.numel() != flat_x.shape[0]:
        raise RuntimeError(f"RISD gate has {mask.numel()} entries for a forward of {flat_x.shape[0]} tokens")
    out = add_gated_lora(base.reshape(-1, base.shape[-1]), flat_x, lora.lora_a, lora.lora_b, 1.0, mask)
    return out.reshape(base.shape)


def _active_lora(layer) -> LayerLoRA | None:
    lora = getattr(layer, "_selfspec_lora", None)
    return lora if lora is not None and lora.gate.mask is not None else None


def _apply_around(original, self, layer, x, bias=None, *args, **kwargs):
    base = original(self, layer, x, bias, *args, **kwargs)
    lora = _active_lora(layer)
    return base if lora is None else _gated_output(lora, x, base)


def _apply_into_around(original, self, layer, x, output, bias=None, *args, **kwargs):
    result = original(self, layer, x, output, bias, *args, **kwargs)
    lora = _active_lora(layer)
    if lora is None:
        return result
    target = output if result is None else result
    target.copy_(_gated_output(lora, x, target))
    return result


def _embedding_around(original, self, layer, input_, *args, **kwargs):
    out = original(self, layer, input_, *args, **kwargs)
    upd: EmbeddingUpdate | None = getattr(layer, "_selfspec_embedding", None)
    if upd is None or upd.gate.mask is None:
        return out
    mask = upd.gate.mask.reshape(-1)
    flat = input_.reshape(-1)
    if mask.numel() != flat.numel():
        raise RuntimeError(f"RISD gate has {mask.numel()} entries for {flat.numel()} input tokens")
    adapted = torch.nn.functional.embedding(flat, upd.weight).to(out.dtype)
    return torch.where(mask.to(out.device).unsqueeze(-1), adapted, out.reshape(-1, out.shape[-1])).reshape(out.shape)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    base = "sglang.srt.layers.quantization.unquant"
    HookRegistry.register(f"{base}.UnquantizedLinearMethod.apply", _apply_around, HookType.AROUND)
    HookRegistry.register(f"{base}.UnquantizedLinearMethod.apply_into", _apply_into_around, HookType.AROUND)
    HookRegistry.register(f"{base}.UnquantizedEmbeddingMethod.embedding", _embedding_around, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
                          ".capture_one_shape", _capture_around, HookType.AROUND)


# ------------------------------------------------------------------------------ attaching an adapter
def read_adapter(adapter_dir: str | Path):
    """PEFT adapter -> ({hf_module: (A, B, scaling)}, {embedding_module: (kind, payload)}, config)."""
    from selfspec.engines.lora import parse_adapter

    try:
        adapter = parse_adapter(adapter_dir)
    except ValueError as err:
        raise LoRAAttachError(f"RISD adapter: {err}") from None
    emb: dict[str, tuple[str, torch.Tensor]] = {name: ("rows", rows) for name, rows in adapter.token_rows.items()}
    for name, params in adapter.saved.items():
        if set(params) != {"weight"}:
            raise LoRAAttachError(f"RISD adapter {adapter_dir}: modules_to_save {name} has a bias; only embedding "
                                  "tables are supported")
        emb[name] = ("table", params["weight"])
    return adapter.lora, emb, adapter.config


# ------------------------------------------------------------------------------ tensor parallelism
@dataclass(frozen=True)
class LayerShard:
    """Which part of a full LoRA a tensor-parallel layer holds: `rows` (start, size) of B's output
    per fused part (column-parallel; None: all rows), `cols` (start, size) of A's input
    (row-parallel; None: all columns)."""

    rows: tuple[tuple[int, int], ...] | None = None
    cols: tuple[int, int] | None = None


def shard_lora(lora_a: torch.Tensor, lora_b: torch.Tensor, part_sizes: list[int],
               shard: LayerShard) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in], B [sum(part_sizes), r] (fused parts stacked in order) -> this rank's A and B."""
    if shard.cols is not None:
        start, size = shard.cols
        lora_a = lora_a[:, start:start + size]
    if shard.rows is not None:
        offsets = [0]
        for size in part_sizes:
            offsets.append(offsets[-1] + size)
        lora_b = torch.cat([lora_b[offsets[i] + start: offsets[i] + start + size]
                            for i, (start, size) in enumerate(shard.rows)])
    return lora_a.contiguous(), lora_b.contiguous()


def layer_shard(layer) -> LayerShard:
    """The shard an SGLang linear layer holds (`LayerShard()` without tensor parallelism)."""
    from sglang.srt.distributed.utils import get_group_rank_size
    from sglang.srt.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if isinstance(layer, RowParallelLinear):
        rank, size = get_group_rank_size(layer.tp_group)
        n = layer.input_size_per_partition
        return LayerShard(cols=(rank * n, n)) if size > 1 and layer.input_is_parallel else LayerShard()
    if isinstance(layer, QKVParallelLinear):
        rank, size = get_group_rank_size(layer.tp_group)
        if size == 1:
            return LayerShard()
        kv_rank, _ = get_group_rank_size(layer.kv_tp_group)
        kv_shard = kv_rank // layer.num_kv_head_replicas
        q, k, v = layer.q_proj_shard_size, layer.kv_proj_shard_size, layer.v_proj_shard_size
        return LayerShard(rows=((rank * q, q), (kv_shard * k, k), (kv_shard * v, v)))
    if isinstance(layer, ColumnParallelLinear):
        rank, size = get_group_rank_size(layer.tp_group)
        if size == 1:
            return LayerShard()
        parts = list(getattr(layer, "output_sizes", None) or [layer.output_size])
        return LayerShard(rows=tuple((rank * (p // size), p // size) for p in parts))
    return LayerShard()


def full_part_sizes(layer) -> list[int]:
    """The full (unsharded) output size of each fused part of a layer, as the HF model has them."""
    from sglang.srt.layers.linear import QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        kv = layer.total_num_kv_heads
        return [layer.total_num_heads * layer.head_size, kv * layer.head_size, kv * layer.v_head_size]
    sizes = list(getattr(layer, "output_sizes", None) or [])
    return sizes or [layer.weight.shape[0]]


def vocab_shard(layer) -> tuple[int, int]:
    """(first token id, count) of the vocabulary rows an SGLang embedding holds on this rank."""
    idx = getattr(layer, "shard_indices", None)
    if idx is None:
        return 0, layer.weight.shape[0]
    return int(idx.org_vocab_start_index), int(idx.org_vocab_end_index - idx.org_vocab_start_index)


def attach_to_sglang_model(model: torch.nn.Module, adapter_dir: str) -> GatedLoRAHandle:
    """Attach a PEFT RISD adapter to an SGLang model's linear / embedding layers (in place), each
    layer's shard of it under tensor parallelism."""
    loras, embs, config = read_adapter(adapter_dir)
    gate = set_model_gate(model, LoRAGate())
    modules = dict(model.named_modules())
    # group parts per SGLang layer
    groups: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    direct: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for hf_name, abs_ in loras.items():
        parent, _, leaf = hf_name.rpartition(".")
        if leaf in _FUSED:
            fused, idx = _FUSED[leaf]
            target = f"{parent}.{fused}"
            if target not in modules and hf_name in modules:
                direct[hf_name] = abs_
                continue
            groups.setdefault(target, {})[idx] = abs_
        elif leaf in ("lm_head", "embed_tokens") or "lm_head" in hf_name:
            raise LoRAAttachError(f"RISD adapter {adapter_dir}: LoRA on {hf_name} is not supported (linear "
                                  "projections only)")
        else:
            direct[hf_name] = abs_
    layers: dict[str, LayerLoRA] = {}
    for name, abs_ in direct.items():
        layer = modules.get(name)
        if layer is None or not hasattr(layer, "weight"):
            raise LoRAAttachError(f"RISD adapter {adapter_dir}: target {name} is not a layer of the served model")
        a, b, s = abs_
        a, b = shard_lora(a.float(), (b * s).float(), [b.shape[0]], layer_shard(layer))
        layers[name] = _attach(layer, a, b, name, gate)
    for name, parts in groups.items():
        layer = modules.get(name)
        if layer is None:
            raise LoRAAttachError(f"RISD adapter {adapter_dir}: fused target {name} is not a layer of the served model")
        if not getattr(layer, "output_sizes", None):
            raise LoRAAttachError(f"RISD adapter {adapter_dir}: {name} has no output_sizes to place the LoRA parts")
        sizes = full_part_sizes(layer)
        in_features = int(getattr(layer, "input_size", layer.weight.shape[1]))
        a_parts, r_total = [], 0
        for idx, (a, b, s) in sorted(parts.items()):
            a_parts.append((idx, a, b * s))
            r_total += a.shape[0]
        lora_a = torch.zeros(r_total, in_features, dtype=torch.float32)
        lora_b = torch.zeros(sum(sizes), r_total, dtype=torch.float32)
        offs = [0]
        for size in sizes:
            offs.append(offs[-1] + size)
        col = 0
        for idx, a, b in a_parts:
            r = a.shape[0]
            if a.shape[1] != in_features or b.shape[0] != sizes[idx]:
                raise LoRAAttachError(f"RISD adapter {adapter_dir}: part {idx} of {name} has shapes {tuple(a.shape)}, "
                                      f"{tuple(b.shape)}; the layer expects in {in_features}, out {sizes[idx]}: "
                                      "the adapter was trained on another base")
            lora_a[col:col + r] = a.float()
            lora_b[offs[idx]:offs[idx + 1], col:col + r] = b.float()
            col += r
        lora_a, lora_b = shard_lora(lora_a, lora_b, sizes, layer_shard(layer))
        layers[name] = _attach(layer, lora_a, lora_b, name, gate)
    embeddings: dict[str, EmbeddingUpdate] = {}
    indices = config.get("trainable_token_indices")
    for name, (kind, tensor) in embs.items():
        if "lm_head" in name:
            raise LoRAAttachError(f"RISD adapter {adapter_dir}: a replaced lm_head is not supported")
        layer = modules.get(name)
        if layer is None or not hasattr(layer, "weight"):
            raise LoRAAttachError(f"RISD adapter {adapter_dir}: embedding update for {name}, not a layer of the model")
        table = layer.weight.detach().clone()  # this rank's vocabulary rows (all of them without TP)
        first, count = vocab_shard(layer)
        if kind == "rows":
            idx = indices if isinstance(indices, list) else (indices or {}).get(name.split(".")[-1])
            if idx is None:
                raise LoRAAttachError(f"RISD adapter {adapter_dir}: trainable token rows for {name} without indices")
            for row, token in zip(tensor, idx):
                if first <= int(token) < first + count:
                    table[int(token) - first] = row.to(table.device, table.dtype)
        else:
            vocab = int(getattr(layer, "org_vocab_size", table.shape[0]))
            if tuple(tensor.shape) != (vocab, table.shape[1]):
                raise LoRAAttachError(f"RISD adapter {adapter_dir}: {name} table {tuple(tensor.shape)} does not fit "
                                      f"{(vocab, table.shape[1])}: the adapter was trained on another base")
            table[:count] = tensor[first:first + count].to(table.device, table.dtype)
        layer._selfspec_embedding = EmbeddingUpdate(table, gate)
        embeddings[name] = layer._selfspec_embedding
    if not layers and not embeddings:
        raise LoRAAttachError(f"RISD adapter {adapter_dir} changes nothing in the served model")
    return GatedLoRAHandle(layers, embeddings, str(adapter_dir), gate)


def _attach(layer, lora_a: torch.Tensor, lora_b: torch.Tensor, name: str, gate: LoRAGate) -> LayerLoRA:
    w = layer.weight
    if lora_a.shape[1] != w.shape[1] or lora_b.shape[0] != w.shape[0]:
        raise LoRAAttachError(f"RISD LoRA for {name}: A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit "
                              f"weight {tuple(w.shape)}: the adapter was trained on another base")
    lora = LayerLoRA(lora_a.to(w.device, w.dtype).contiguous(), lora_b.to(w.device, w.dtype).contiguous(), gate)
    layer._selfspec_lora = lora
    return lora
