"""The checkpoints I-DLM and Jacobi Forcing publish, served with no selfspec.json, by path and
by Hub name from an offline Hub cache (`published_layouts.py` builds config-faithful miniatures
of each release from the embedded weights; docs/checkpoints.md).

The start-up resolution runs in this process (SGLang's own argument parsing and resolution with
the plugin loaded); three releases are served by `python -m sglang.launch_server` and held to
stock AR on the same weights run causally, with the mode's own steps read from /server_info.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import published_layouts as pl
from sglang_fixtures import (
    DEFAULT_PATH,
    check_lossless,
    internal_state,
    native_generate,
    resolve_in_process,
    server_args,
    start_server,
)

SDAR_HUB = "yifanyu/I-DLM-8B"
BASE_HUB = "Qwen/Qwen3-8B"
LORA_HUB = "yifanyu/I-DLM-8B-lora-r128"
JF_HUB = "JacobiForcing/JacobiForcing_Coder_7B_v1"


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    """Each miniature as a folder, and the same files in one offline Hub cache (`hf_home`)."""
    root = tmp_path_factory.mktemp("published")
    out = {
        "sdar": pl.make_sdar(root / "I-DLM-8B"),
        "sdar_blocks": pl.make_sdar(root / "SDAR-block-diffusion", causal={"block_size": 4}),
        "base": pl.make_maskless_base(root / "Qwen3-8B"),
        "lora": pl.make_bare_adapter(root / "I-DLM-8B-lora-r128", BASE_HUB, weights="bin"),
        "lora_safetensors": pl.make_bare_adapter(root / "lora-st", BASE_HUB, weights="safetensors"),
        "jf": pl.make_qwen2_bin(root / "JacobiForcing_Coder_7B_v1"),
        "hf_home": root / "hf",
    }
    for repo, key in ((SDAR_HUB, "sdar"), (BASE_HUB, "base"), (LORA_HUB, "lora"), (JF_HUB, "jf")):
        pl.put_in_hub_cache(out["hf_home"], repo, out[key])
    return out


@pytest.fixture
def offline_hub(releases, monkeypatch):
    """The Hub cache of `releases`, offline, for this process (huggingface_hub reads these at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(releases["hf_home"] / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return releases


def _argv(model, *extra):
    return ["--model-path", str(model), "--device", "cpu", "--attention-backend", "torch_native",
            "--max-total-tokens", "4096", *extra]


def _resolved(monkeypatch, model, *extra):
    """(SGLang's resolved server arguments, the selfspec configuration the launcher publishes)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from selfspec.sglang_ext import config as cfgmod

    seen = []
    monkeypatch.setattr(cfgmod, "publish", seen.append)
    sa = resolving_view(resolve_in_process(_argv(model, *extra)))
    return sa, seen[-1]


def _fails(model, *extra) -> str:
    from selfspec.sglang_ext.config import SelfSpecConfigError

    with pytest.raises(SelfSpecConfigError) as info:
        resolve_in_process(_argv(model, *extra))
    return str(info.value)


# ------------------------------------------------------------------ SDAR (I-DLM-8B / 32B)
@pytest.mark.parametrize("where", ["path", "hub"])
def test_sdar_is_served_causally_with_the_mask_id_of_its_config(offline_hub, monkeypatch, where):
    model = offline_hub["sdar"] if where == "path" else SDAR_HUB
    sa, cfg = _resolved(monkeypatch, model, "--speculative-algorithm", "ISD", "--trust-remote-code")
    assert json.loads(sa.json_model_override_args) == {"architectures": ["Qwen3ForCausalLM"]}
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.mask_token_id == pl.mask_token_id() and cfg.sources["mask_token_id"] == "config.json mask_token_id"
    if where == "hub":
        assert "models--yifanyu--I-DLM-8B" in cfg.model_dir


def test_a_user_override_is_kept_beside_the_causal_class(offline_hub, monkeypatch):
    sa, _ = _resolved(monkeypatch, SDAR_HUB, "--speculative-algorithm", "ISD", "--trust-remote-code",
                      "--json-model-override-args", '{"max_position_embeddings": 2048}')
    assert json.loads(sa.json_model_override_args) == {"max_position_embeddings": 2048,
                                                       "architectures": ["Qwen3ForCausalLM"]}


def test_sdar_that_is_not_causal_or_needs_remote_code_is_refused(offline_hub, monkeypatch):
    problem = _fails(offline_hub["sdar_blocks"], "--speculative-algorithm", "ISD", "--trust-remote-code")
    assert "block-diffusion model (block_size 4, no use_regular_causal)" in problem and "--dllm-algorithm" in problem
    flagged = pl.make_sdar(offline_hub["hf_home"].parent / "flagged",
                           causal={"block_size": 4, "use_regular_causal": True})
    _, cfg = _resolved(monkeypatch, flagged, "--speculative-algorithm", "ISD", "--trust-remote-code")
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert "add --trust-remote-code" in _fails(SDAR_HUB, "--speculative-algorithm", "ISD")


def test_sdar_built_in_code_must_ask_for_the_causal_class(offline_hub, monkeypatch):
    """A server built without the launcher's CLI (no override set) is refused, never served as
    SGLang's non-causal SDAR class."""
    from types import SimpleNamespace

    from selfspec.sglang_ext import config as cfgmod

    monkeypatch.delenv(cfgmod.FLAGS_ENV, raising=False)
    args = SimpleNamespace(speculative_algorithm="ISD", model_path=SDAR_HUB, revision=None,
                           json_model_override_args="{}", tokenizer_path=None)
    with pytest.raises(cfgmod.SelfSpecConfigError, match="must be served as Qwen3ForCausalLM"):
        cfgmod.resolve(args)


def test_a_hub_name_that_is_not_here_names_the_download(offline_hub):
    problem = _fails("yifanyu/I-DLM-32B", "--speculative-algorithm", "ISD", "--trust-remote-code")
    assert "HF_HUB_OFFLINE is set and it is not in the cache" in problem
    assert "hf download yifanyu/I-DLM-32B" in problem


def test_mask_id_order_flag_metadata_config_tokenizer(tmp_path, monkeypatch):
    """--selfspec-mask-token-id, then selfspec.json, then config.json, then the tokenizer."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(pl.ASSETS / "tiny-base", model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "mask_token_id": 7}))
    (model / "selfspec.json").write_text(json.dumps({"mask_token_id": 5}))
    run = ("--speculative-algorithm", "ISD")
    assert _resolved(monkeypatch, model, *run, "--selfspec-mask-token-id", "9")[1].mask_token_id == 9
    _, got = _resolved(monkeypatch, model, *run)
    assert (got.mask_token_id, got.sources["mask_token_id"]) == (5, f"{model.resolve()}/selfspec.json")
    (model / "selfspec.json").unlink()
    _, got = _resolved(monkeypatch, model, *run)
    assert (got.mask_token_id, got.sources["mask_token_id"]) == (7, "config.json mask_token_id")
    (model / "config.json").write_text(json.dumps(cfg))
    _, got = _resolved(monkeypatch, model, *run)
    assert (got.mask_token_id, got.sources["mask_token_id"]) == (pl.mask_token_id(), "the tokenizer's mask_token")


def test_vocabulary_size_from_a_nested_text_config(tmp_path, monkeypatch):
    """JACOBI reads the vocabulary size from config.json, nested under text_config in multimodal
    releases (SGLang serves their text model)."""
    from selfspec.decoding.modes.jacobi import JacobiMode
    from selfspec.sglang_ext import config as cfgmod

    _, cfg = _resolved(monkeypatch, pl.ASSETS / "tiny-base", "--speculative-algorithm", "JACOBI",
                       "--selfspec-policy", "own")
    text = json.loads((pl.ASSETS / "tiny-base" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": text}))
    cfg.model_dir = str(tmp_path)
    mode = cfgmod.build_mode(cfg)
    assert isinstance(mode, JacobiMode) and mode.vocab_size == text["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    with pytest.raises(cfgmod.SelfSpecConfigError, match="has no vocab_size"):
        cfgmod.build_mode(cfg)


# ------------------------------------------------------------------ I-DLM's algorithm config
IDLM_YAML = """\
block_size: 7
gen_block_size: 4
confidence_threshold: 0.0
temperature: 1.0
top_k: 50
top_p: 0.95
use_spec_verify: true
verify_alpha: 0.8
remasking: low_confidence
"""


def test_idlm_algorithm_config_maps_onto_isd(offline_hub, monkeypatch, tmp_path):
    f = tmp_path / "idlm_blockN4_config.yaml"
    f.write_text(IDLM_YAML)
    sa, cfg = _resolved(monkeypatch, SDAR_HUB, "--speculative-algorithm", "ISD", "--trust-remote-code",
                        "--selfspec-config", str(f), "--selfspec-policy", "own")
    assert cfg.options["stride"] == 4 and cfg.options["tau"] == pytest.approx(0.25)
    assert cfg.sources["stride"] == f"--selfspec-config {f}"
    assert sa.speculative_num_draft_tokens == 7  # block_size: 2N - 1
    assert dict(sa.preferred_sampling_params) == {"temperature": 1.0, "top_k": 50, "top_p": 0.95}
    from selfspec.checkpoints.published import from_idlm_algorithm_config
    from selfspec.sglang_ext.config import load_yaml_config

    settings = from_idlm_algorithm_config(load_yaml_config(f), str(f))
    assert settings.unmapped == ["remasking='low_confidence' (no ISD equivalent)"]  # named, not applied
    assert "remasking" not in cfg.options and cfg.sampling_defaults == dict(sa.preferred_sampling_params)


@pytest.mark.parametrize("edit, algorithm, problem", [
    ("block_size: 5", "ISD", "block_size 5 must be 2 * gen_block_size - 1 = 7"),
    ("verify_alpha: 1.5", "ISD", "verify_alpha 1.5 has no ISD equivalent"),
    ("use_spec_verify: false", "ISD", "ISD always verifies"),
    ("", "JACOBI", "configures ISD / RISD, not JACOBI"),
])
def test_idlm_algorithm_config_errors_name_the_key(offline_hub, tmp_path, edit, algorithm, problem):
    f = tmp_path / "idlm.yaml"
    key = edit.split(":")[0]
    f.write_text("".join(line + "\n" for line in IDLM_YAML.splitlines() if not key or not line.startswith(key))
                 + edit + "\n")
    assert problem in _fails(SDAR_HUB, "--speculative-algorithm", algorithm, "--trust-remote-code",
                             "--selfspec-config", str(f))


# ------------------------------------------------------------------ Jacobi Forcing presets
def test_jacobi_forcing_preset_by_flag_and_by_hub_organisation(offline_hub, monkeypatch):
    from selfspec.checkpoints.published import PRESETS

    want = PRESETS["jacobi-forcing"].options
    _, by_flag = _resolved(monkeypatch, offline_hub["jf"], "--speculative-algorithm", "JACOBI",
                           "--selfspec-preset", "jacobi-forcing")
    _, by_name = _resolved(monkeypatch, JF_HUB, "--speculative-algorithm", "JACOBI")
    for cfg, source in ((by_flag, "--selfspec-preset jacobi-forcing"), (by_name, "preset jacobi-forcing")):
        assert {k: cfg.options[k] for k in want} == want
        assert cfg.sources["block_size"].startswith(source)
        own = [b for b in cfg.plan["greedy"] if b["mode"] == "jacobi"]  # the policy keeps the preset's blocks
        assert own and all(b.get("block_size", want["block_size"]) == 64 for b in own)
    _, plain = _resolved(monkeypatch, offline_hub["jf"], "--speculative-algorithm", "JACOBI")
    assert plain.options["block_size"] != 64
    assert "is a JACOBI preset" in _fails(offline_hub["jf"], "--speculative-algorithm", "ISD",
                                          "--selfspec-preset", "jacobi-forcing")


# ------------------------------------------------------------------ bare PEFT adapters
@pytest.mark.parametrize("adapter", ["lora", "lora_safetensors", "hub"])
def test_a_bare_peft_adapter_attaches_by_folder_or_hub_name(offline_hub, monkeypatch, adapter):
    lora = LORA_HUB if adapter == "hub" else offline_hub[adapter]
    mask = str(pl.mask_token_id())
    _, cfg = _resolved(monkeypatch, BASE_HUB, "--speculative-algorithm", "RISD", "--selfspec-lora", str(lora),
                       "--selfspec-mask-token-id", mask)
    assert Path(cfg.adapter).is_dir() and cfg.mask_token_id == int(mask)
    assert "names no mask token" in _fails(BASE_HUB, "--speculative-algorithm", "RISD", "--selfspec-lora", str(lora))


def _wider(state):
    return {k: (v.repeat(1, 2) if "lora_A" in k else v) for k, v in state.items()}


def _extra_target(state):
    k = next(iter(state))
    return {**state, k.replace(k.split(".lora_")[0].split(".")[-1], "c_attn"): state[k].clone()}


def _other_rank(state):
    return {k: (v[:8] if "lora_A" in k else v[:, :8]).contiguous() for k, v in state.items()}


@pytest.mark.parametrize("edit, problem", [
    (_wider, "which does not fit"),
    (_extra_target, "adapts module 'c_attn'"),
    (_other_rank, "its adapter_config.json says 64"),
])
def test_an_adapter_of_another_base_fails_at_start_up_naming_the_module(offline_hub, tmp_path, edit, problem):
    lora = pl.make_bare_adapter(tmp_path / "other", BASE_HUB, weights="safetensors", state_edit=edit)
    got = _fails(BASE_HUB, "--speculative-algorithm", "RISD", "--selfspec-lora", str(lora),
                 "--selfspec-mask-token-id", str(pl.mask_token_id()))
    assert problem in got


# ------------------------------------------------------------------ served
def _served_state(base_url: str) -> dict:
    return internal_state(base_url)["selfspec"]


@pytest.fixture
def hub_env(releases) -> dict:
    return {"HF_HOME": str(releases["hf_home"]), "HF_HUB_OFFLINE": "1"}


@pytest.mark.server
def test_sdar_by_hub_name_serves_isd_equal_to_its_weights_run_causally(tmp_path_factory, releases, hub_env,
                                                                      heldout_ids, ar_reference):
    """The SDAR miniature holds tiny-base's weights: greedy ISD must equal tiny-base's stock AR
    (SGLang's own SDAR class, a non-causal prefill, answers otherwise), with ISD's own steps."""
    # SGLang's default path: radix cache on, prompts prefilled in 16-token chunks
    proc = start_server(tmp_path_factory, "sdar", server_args(*DEFAULT_PATH, "--trust-remote-code",
                                                              "--speculative-algorithm", "ISD"),
                        model=SDAR_HUB, env=hub_env)
    try:
        check_lossless(proc.base_url, heldout_ids, ar_reference, concurrent=False)
        state = _served_state(proc.base_url)
        assert state["resolved"]["model_class"] == "Qwen3ForCausalLM"
        assert state["resolved"]["sources"]["mask_token_id"] == "config.json mask_token_id"
        assert state["steps_by_kind"]["own"]["tokens"] > 0 and state["tokens_per_forward"] > 1.0, state
    finally:
        proc.stop()


@pytest.mark.server
def test_bare_lora_over_a_maskless_base_serves_risd_equal_to_the_base(tmp_path_factory, releases, hub_env,
                                                                     heldout_ids, ar_reference):
    """The adapter rides RISD's own steps (policy `own`: every greedy step, at every batch size of
    the burst; the default policy runs them only at batch 1, which a 16-request burst that ends
    together may never reach) and the outputs stay the base's."""
    proc = start_server(tmp_path_factory, "bare-lora", server_args(
        "--disable-radix-cache", "--speculative-algorithm", "RISD", "--selfspec-lora", LORA_HUB,
        "--selfspec-mask-token-id", str(pl.mask_token_id()), "--selfspec-policy", "own"),
        model=BASE_HUB, env=hub_env)
    try:
        check_lossless(proc.base_url, heldout_ids, ar_reference, concurrent=True)
        state = _served_state(proc.base_url)
        assert state["adapter"] is not None and state["adapter"]["layers"] > 0, state["adapter"]
        assert "models--yifanyu--I-DLM-8B-lora-r128" in state["resolved"]["adapter"]
        assert state["steps_by_kind"]["own"]["tokens"] > 0, state
    finally:
        proc.stop()


@pytest.mark.server
def test_jacobi_forcing_release_serves_its_preset_equal_to_stock_ar(tmp_path_factory, releases, hub_env,
                                                                   heldout_ids, ar_reference):
    prompts = heldout_ids[:8]
    ar = start_server(tmp_path_factory, "jf-ar", server_args("--disable-radix-cache", "--disable-overlap-schedule"),
                      model=JF_HUB, env=hub_env)
    try:
        reference = [native_generate(ar.base_url, ids)["output_ids"] for ids in prompts]
    finally:
        ar.stop()
    assert len({tuple(r) for r in reference}) > 1  # it writes text, not one token over and over
    proc = start_server(tmp_path_factory, "jf", server_args("--disable-radix-cache", "--speculative-algorithm",
                                                            "JACOBI", "--selfspec-policy", "own"),
                        model=JF_HUB, env=hub_env)
    try:
        check_lossless(proc.base_url, prompts, reference, concurrent=False)
        state = _served_state(proc.base_url)
        assert state["resolved"]["options"]["block_size"] == 64 and state["resolved"]["options"]["max_blocks"] == 2
        assert state["resolved"]["model_class"] == "Qwen2ForCausalLM"
        assert state["steps_by_kind"]["own"]["tokens"] > 0 and state["tokens_per_forward"] > 1.0, state
    finally:
        proc.stop()
