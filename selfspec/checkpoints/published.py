"""The published checkpoints of I-DLM and Jacobi Forcing, served as their papers decode them.

- **SDAR (I-DLM-8B / 32B)**: I-DLM publishes its dense models as `SDARForCausalLM`. Stock
  SGLang's class of that name builds its attention as ENCODER_ONLY (a non-causal prefill, for
  its dLLM path), which is not the model introspective decoding verifies against. A causal SDAR
  checkpoint (`use_regular_causal: true`, or blocks of one token) has Qwen3's weights and
  layers, so it is served through SGLang's causal `Qwen3ForCausalLM`; a block-diffusion one
  (non-causal inside its blocks) is refused at start-up.
- **I-DLM's algorithm config** (`--dllm-algorithm-config idlm_blockN4_config.yaml` of its
  SGLang fork): `gen_block_size` is ISD's stride N, `block_size` its 2N-1 query tokens,
  `verify_alpha` the relaxed acceptance min(1, p / (alpha q)) = tau's min(1, (1+tau) p / q)
  with tau = 1/alpha - 1, the sampling keys the server's default sampling parameters.
- **Presets** for published checkpoints that carry no selfspec.json (`--selfspec-preset`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from selfspec.errors import UserError
from selfspec.checkpoints.files import is_repo_id

SDAR_ARCHITECTURE = "SDARForCausalLM"
#: SGLang's causal class with SDAR's dense layout (Qwen3's weight names, q/k norms)
CAUSAL_ARCHITECTURE = "Qwen3ForCausalLM"
_SDAR_UNSUPPORTED = ("SDARMoeForCausalLM",)


class PublishedFormatError(UserError):
    """A published checkpoint or config that selfspec cannot serve as its method decodes it."""


def architectures(config: dict[str, Any]) -> list[str]:
    return [str(a) for a in (config.get("architectures") or [])]


def served_architecture(config: dict[str, Any], model: str) -> str | None:
    """The architecture SGLang must load `model` as for a selfspec mode, or None to keep its own.
    Raises PublishedFormatError for an SDAR model that is not causal."""
    archs = architectures(config)
    if any(a in _SDAR_UNSUPPORTED for a in archs):
        raise PublishedFormatError(
            f"{model} is an SDAR mixture-of-experts model ({archs[0]}); the selfspec modes serve causal dense "
            "models: serve it with SGLang's own --dllm-algorithm path instead")
    if SDAR_ARCHITECTURE not in archs and config.get("model_type") != "sdar":
        return None
    block = config.get("block_size")
    if config.get("use_regular_causal") is True or (block is not None and int(block) == 1):
        return CAUSAL_ARCHITECTURE
    why = (f"block_size {block}, no use_regular_causal" if block is not None
           else "no block_size and no use_regular_causal in its config.json")
    raise PublishedFormatError(
        f"{model} is an SDAR block-diffusion model ({why}): its attention is bidirectional inside each block, "
        "and the selfspec modes verify against causal next-token predictions, so serving it would silently "
        "change the model. Serve it with SGLang's --dllm-algorithm instead; if it was trained causally "
        "(I-DLM's checkpoints are), its config.json should say use_regular_causal: true (or block_size: 1)")


# ------------------------------------------------------------------------ I-DLM's algorithm config
#: sampling keys of I-DLM's config, served as the server's default sampling parameters
_IDLM_SAMPLING = ("temperature", "top_k", "top_p")


@dataclass
class IdlmSettings:
    options: dict[str, Any]  # ISD options
    sampling: dict[str, Any]  # default sampling parameters of the server
    mapped: list[str] = field(default_factory=list)  # "key=value -> what", for the start-up log
    unmapped: list[str] = field(default_factory=list)  # keys with no equivalent, with the reason


def is_idlm_algorithm_config(data: dict[str, Any]) -> bool:
    return "gen_block_size" in data


def from_idlm_algorithm_config(data: dict[str, Any], source: str) -> IdlmSettings:
    """ISD's options from I-DLM's `--dllm-algorithm-config` YAML (keys already `_`-normalised)."""
    data = dict(data)
    out = IdlmSettings({}, {})
    n = int(data.pop("gen_block_size"))
    out.options["stride"] = n
    out.mapped.append(f"gen_block_size={n} -> stride {n}")
    if "block_size" in data:
        block = int(data.pop("block_size"))
        if block != 2 * n - 1:
            raise PublishedFormatError(f"{source}: block_size {block} must be 2 * gen_block_size - 1 = {2 * n - 1} "
                                       "(N proposals verified beside N-1 [MASK] rows); fix one of them")
        out.mapped.append(f"block_size={block} -> {block} query tokens per step")
    if "verify_alpha" in data:
        alpha = float(data.pop("verify_alpha"))
        if not 0 < alpha <= 1:
            raise PublishedFormatError(
                f"{source}: verify_alpha {alpha} has no ISD equivalent: ISD's relaxed acceptance (1+tau) p/q "
                "with tau >= 0 is verify_alpha in (0, 1] (1: the model's own distribution)")
        tau = 1.0 / alpha - 1.0
        out.options["tau"] = round(tau, 12)
        out.mapped.append(f"verify_alpha={alpha:g} -> tau {tau:g}")
    if "use_spec_verify" in data:
        verify = data.pop("use_spec_verify")
        if verify is not True:
            raise PublishedFormatError(f"{source}: use_spec_verify {verify!r}: ISD always verifies its proposals "
                                       "(that is what keeps it lossless); remove the key or set it true")
        out.mapped.append("use_spec_verify=true -> ISD's verify (always on)")
    for key in _IDLM_SAMPLING:
        if key in data:
            out.sampling[key] = data.pop(key)
            out.mapped.append(f"{key}={out.sampling[key]} -> default sampling parameter")
    threshold = data.pop("confidence_threshold", None)
    if threshold is not None:
        if float(threshold) == 0.0:
            out.mapped.append("confidence_threshold=0 -> none (ISD accepts by verification only)")
        else:
            out.unmapped.append(f"confidence_threshold={threshold} (confidence-based acceptance; ISD accepts "
                                "by verification only)")
    out.unmapped += [f"{k}={v!r} (no ISD equivalent)" for k, v in data.items()]
    return out


# ------------------------------------------------------------------------ presets
@dataclass(frozen=True)
class Preset:
    algorithm: str
    options: dict[str, Any]
    summary: str
    hub_orgs: tuple[str, ...] = ()  # Hub organisations whose models pick the preset by themselves


PRESETS: dict[str, Preset] = {
    # Jacobi Forcing's recommended decoding (its paper and HumanEval script): n = 64, K = 2 blocks,
    # spawn at r = 0.85, an n-gram pool of 4, 4 candidates verified; fresh blocks from random
    # vocabulary draws as the paper describes. The CPU defaults are smaller (docs/checkpoints.md).
    "jacobi-forcing": Preset(
        "JACOBI", {"block_size": 64, "max_blocks": 2, "spawn_ratio": 0.85, "pool_size": 4, "verify_size": 4,
                   "init": "random"},
        "Jacobi Forcing's published 7B models: n=64, K=2, r=0.85, pool 4, verify 4, random init",
        hub_orgs=("JacobiForcing",)),
}


def preset_for(name: str | None, model_path: str, algorithm: str) -> tuple[str, Preset] | None:
    """The preset asked for by name, else one whose Hub organisation serves `model_path` under
    `algorithm`; None when neither. An unknown name or a preset of another mode raises."""
    if name is not None:
        if name not in PRESETS:
            raise PublishedFormatError(f"--selfspec-preset {name}: no such preset; choose one of "
                                       f"{', '.join(PRESETS)}")
        preset = PRESETS[name]
        if preset.algorithm != algorithm:
            raise PublishedFormatError(f"--selfspec-preset {name} is a {preset.algorithm} preset but "
                                       f"--speculative-algorithm is {algorithm}: use the matching algorithm")
        return name, preset
    org = _hub_org(model_path)
    for key, preset in PRESETS.items():
        if preset.algorithm == algorithm and org in preset.hub_orgs:
            return key, preset
    return None


def _hub_org(model_path: str) -> str | None:
    """ORG of an `ORG/NAME` Hub name, or of a Hub cache snapshot folder (models--ORG--NAME)."""
    for part in str(model_path).split("/"):
        if part.startswith("models--"):
            return part.split("--")[1]
    return str(model_path).split("/")[0] if is_repo_id(str(model_path)) else None
