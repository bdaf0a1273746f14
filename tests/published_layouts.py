"""Config-faithful miniatures of the checkpoints I-DLM and Jacobi Forcing publish, built from the
embedded weights, and an offline Hugging Face Hub cache to put them in.

Each keeps what the release's files carry (docs/checkpoints.md): file layout, config keys,
architecture name, special tokens, weight names; with the embedded models' small dimensions.
- `make_sdar`: I-DLM-8B / 32B as published: `SDARForCausalLM`, `model_type: sdar`, its config
  class as remote code (`auto_map` -> configuration_sdar.SDARConfig), `mask_token_id` only in
  config.json (the tokenizer declares none), an untied `lm_head`, sharded safetensors with an
  index. Its weights are tiny-base's: served causally it must answer exactly as tiny-base.
- `make_maskless_base`: a base whose tokenizer declares no mask token (Qwen/Qwen3-8B).
- `make_bare_adapter`: I-DLM-8B-lora-r128 as published: a bare PEFT folder (no selfspec.json)
  naming its base by Hub name, weights in safetensors or `.bin`.
- `make_qwen2_bin`: a Jacobi Forcing 7B release: Qwen2 weights in `pytorch_model.bin`, a
  generation config with an eos list.
- `put_in_hub_cache`: `HF_HOME/hub/models--ORG--NAME/snapshots/REV/...` with `refs/main`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "selfspec" / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

#: the remote-code config class an SDAR release ships (written here from SDAR's documented keys:
#: Qwen3's, plus the block size and the mask token)
SDAR_CONFIG_PY = '''\
from transformers.configuration_utils import PretrainedConfig


class SDARConfig(PretrainedConfig):
    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                 max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                 tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
                 use_sliding_window=False, sliding_window=4096, max_window_layers=28, attention_dropout=0.0,
                 block_size=4, mask_token_id=151669, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.attention_bias = attention_bias
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = max_window_layers
        self.attention_dropout = attention_dropout
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
'''


def _copy_tokenizer(src: Path, out: Path, declare_mask: bool) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if not declare_mask:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg.pop("mask_token", None)
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def special_token_id(content: str, tokenizer_dir: Path = ASSETS / "tiny-base") -> int:
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in added if t["content"] == content)


def mask_token_id(tokenizer_dir: Path = ASSETS / "tiny-base") -> int:
    """The embedded tokenizer's [MASK] id (what the miniatures' configs name)."""
    return special_token_id("[MASK]", tokenizer_dir)


def make_sdar(out: Path, src: Path = ASSETS / "tiny-base", *, causal: dict | None = None, shards: int = 2) -> Path:
    """An SDAR checkpoint of `src`'s weights. `causal`: the config keys that say how it attends
    (I-DLM's: block_size 1; a block-diffusion SDAR model: block_size 4)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    base = json.loads((src / "config.json").read_text())
    config = {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar",
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        **{k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                                "max_position_embeddings", "rms_norm_eps", "attention_bias", "bos_token_id",
                                "eos_token_id", "pad_token_id")},
        "rope_theta": base["rope_parameters"]["rope_theta"], "rope_scaling": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attn_implementation": "flex_attention",
        "mask_token_id": mask_token_id(src), **(causal if causal is not None else {"block_size": 1}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "configuration_sdar.py").write_text(SDAR_CONFIG_PY)
    shutil.copy2(src / "generation_config.json", out / "generation_config.json")
    _copy_tokenizer(src, out, declare_mask=False)
    state = load_file(str(src / "model.safetensors"))
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"].clone())
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = {n: state[n].contiguous() for n in names[i::shards]}
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out


def make_maskless_base(out: Path, src: Path = ASSETS / "tiny-base") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy2(src / name, out / name)
    _copy_tokenizer(src, out, declare_mask=False)
    return out


def make_bare_adapter(out: Path, base_name: str, src: Path = ASSETS / "tiny-idlm-lora",
                      weights: str = "bin", state_edit=None) -> Path:
    """A PEFT folder as PEFT writes it (adapter_config.json + adapter_model.*), no selfspec.json.
    `state_edit(state) -> state`: a change to the weights (an adapter of another base)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = base_name
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    state = load_file(str(src / "adapter_model.safetensors"))
    if state_edit is not None:
        state = state_edit(state)
    if weights == "bin":
        torch.save(state, out / "adapter_model.bin")
    else:
        save_file(state, str(out / "adapter_model.safetensors"))
    return out


def make_qwen2_bin(out: Path, src: Path = ASSETS / "tiny-base") -> Path:
    """A Qwen2 causal LM in `pytorch_model.bin`: tiny-base's weights without its q/k norms (Qwen2
    has none) and zero q/k/v biases (Qwen2 has them), so it writes text, not noise; the
    generation config lists two eos ids, as the Jacobi Forcing releases do."""
    import torch
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    base = json.loads((src / "config.json").read_text())
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        **{k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "hidden_act",
                                "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id")},
        "rope_theta": base["rope_parameters"]["rope_theta"], "tie_word_embeddings": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": base["num_hidden_layers"], "torch_dtype": "bfloat16",
    }
    assert base["head_dim"] * base["num_attention_heads"] == base["hidden_size"], "Qwen2 derives head_dim"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    eos = [base["eos_token_id"], special_token_id("<|im_end|>", src)]
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": base["bos_token_id"], "eos_token_id": eos, "pad_token_id": base["eos_token_id"]}))
    _copy_tokenizer(src, out, declare_mask=True)
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items()
             if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    for i in range(base["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = state[f"model.layers.{i}.self_attn.{proj}.weight"]
            state[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    torch.save(state, out / "pytorch_model.bin")
    return out


def put_in_hub_cache(hf_home: Path, repo_id: str, folder: Path) -> Path:
    """`folder`'s files as the Hub cache holds `repo_id` at its main revision; returns the snapshot."""
    org, name = repo_id.split("/")
    repo = hf_home / "hub" / f"models--{org}--{name}"
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
