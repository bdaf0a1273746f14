"""Package, embedded model, corpus split, CLI errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from selfspec.models import ModelNotFoundError, resolve_model
from selfspec.serving import ServeError, ServerSpec, free_port
from selfspec.corpus import is_heldout, iter_stdlib_files, load_stdlib_split
from selfspec.training.tokenizer import EOS_TOKEN, IM_END, IM_START, MASK_TOKEN


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfspec.cli", *args], capture_output=True, text=True, timeout=120)


def test_corpus_excludes_tests_and_site_packages():
    files = iter_stdlib_files()
    paths = [f.relpath for f in files]
    assert len(paths) > 300
    for p in paths:
        parts = p.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), p
    assert "unittest/case.py" in paths and "argparse.py" in paths


def test_corpus_split_is_deterministic_and_disjoint():
    a, b = load_stdlib_split(), load_stdlib_split()
    assert a.digest() == b.digest()
    train = {f.relpath for f in a.train}
    held = {f.relpath for f in a.heldout}
    assert train and held and not train & held
    assert all(is_heldout(p) for p in held) and not any(is_heldout(p) for p in train)


def test_embedded_tokenizer_round_trip(tiny_base_path, heldout_prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base_path)
    assert 4096 <= len(tok) <= 8192
    for special in (EOS_TOKEN, MASK_TOKEN, IM_START, IM_END):
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, f"{special} is not a single token"
    assert tok.mask_token == MASK_TOKEN and tok.eos_token == EOS_TOKEN
    texts = heldout_prompts[:16] + ["naïve café ☕ — 中文\t\r\n", "    return x  # trailing spaces   \n\n"]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_embedded_model_provenance_and_size(tiny_base_path):
    prov = json.loads((tiny_base_path / "provenance.json").read_text())
    weights = tiny_base_path / "model.safetensors"
    assert weights.stat().st_size <= 12 * 2**20
    assert prov["saved_dtype"] == "bfloat16"
    for key in ("command", "seed", "steps", "tokens_seen", "heldout_loss", "train_loss_last"):
        assert prov[key] is not None, key
    assert prov["corpus"]["sha256"] and prov["corpus"]["heldout_paths"]
    assert 4e6 < prov["parameters"] < 7e6
    config = json.loads((tiny_base_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True


def test_models_command_lists_embedded_models(tiny_base_path):
    out = _cli("models")
    assert out.returncode == 0
    assert "tiny-base" in out.stdout and str(tiny_base_path) in out.stdout


def test_resolve_model_errors_name_the_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="selfspec models"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(tmp_path)


def test_serve_unknown_model_is_one_clear_line():
    out = _cli("serve", "--model", "no-such-model")
    assert out.returncode == 2
    assert "unknown model 'no-such-model'" in out.stderr and "tiny-base" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_port_in_use_is_reported(tiny_base_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _cli("serve", "--model", "tiny-base", "--port", str(port))
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "--port" in out.stderr and "Traceback" not in out.stderr


_FAKE_SERVER = """
import http.server, pathlib, sys
port, marker = int(sys.argv[sys.argv.index("--port") + 1]), pathlib.Path(sys.argv[-1])
attempt = int(marker.read_text()) + 1 if marker.exists() else 1
marker.write_text(str(attempt))
if attempt == 1:  # what uvicorn prints when another process bound the port first
    print("ERROR: [Errno 98] error while attempting to bind on address: address already in use", flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.mark.parametrize("clash", ["address already in use", "some other failure"])
def test_server_start_retries_a_taken_free_port(tmp_path, monkeypatch, clash):
    """A free port chosen for the server can be taken before SGLang binds it (servers started side
    by side): the start is retried on a new port; any other failure is reported at once."""
    from selfspec.serving import ServeError, ServerProcess, ServerSpec

    script, marker = tmp_path / "fake_server.py", tmp_path / "attempts"
    script.write_text(_FAKE_SERVER.replace("address already in use", clash))
    spec = ServerSpec("tiny-base", port=None)
    ports = []

    def command(self):
        self.port = free_port()
        ports.append(self.port)
        return [sys.executable, str(script), "--port", str(self.port), str(marker)], dict(os.environ)

    monkeypatch.setattr(ServerSpec, "command", command)
    proc = ServerProcess(spec, log_path=tmp_path / "server.log", startup_timeout=60)
    if clash != "address already in use":
        with pytest.raises(ServeError, match="exited with code 1"):
            proc.start()
        assert marker.read_text() == "1"
        return
    with proc:
        assert marker.read_text() == "2" and len(ports) == 2
        assert proc.base_url.endswith(f":{ports[-1]}")


def test_serve_without_sglang_names_the_fix(monkeypatch, tiny_base_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(ServeError, match="make setup"):
        ServerSpec("tiny-base", port=1).command()


def test_serve_cpu_defaults_and_passthrough(tiny_base_path, monkeypatch):
    import os

    from selfspec.serving import free_port

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    argv, env = ServerSpec("tiny-base", port=free_port(), cpu=True,
                           extra_args=["--max-total-tokens", "4096", "--speculative-algorithm", "NGRAM"]).command()
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv.count("--max-total-tokens") == 1 and "4096" in argv  # the user's value wins
    assert argv[-2:] == ["--speculative-algorithm", "NGRAM"]
    assert env["OMP_NUM_THREADS"] == "1"  # small machine: one OpenMP thread
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    _, env = ServerSpec("tiny-base", port=free_port(), cpu=True).command()
    assert "OMP_NUM_THREADS" not in env  # a large machine keeps OpenMP's default
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    _, env = ServerSpec("tiny-base", port=free_port(), cpu=True).command()
    assert env["OMP_NUM_THREADS"] == "3"  # the user's setting wins


def _adapter_over_tiny_base(tmp_path):
    """An adapter-only checkpoint naming the embedded tiny-base in its selfspec.json."""
    from model_helpers import save_random_adapter, tiny_qwen3

    adapter = save_random_adapter(tiny_qwen3(64, seed=0), tmp_path / "adapter")
    (adapter / "selfspec.json").write_text(json.dumps({"format_version": 1, "mode": "RISD", "stride": 4,
                                                       "base_model": "tiny-base"}))
    return adapter


def test_adapter_only_checkpoint_serves_as_base_plus_adapter(tmp_path, tiny_base_path):
    from selfspec.models import resolve_with_adapter
    from selfspec.serving import free_port

    adapter = _adapter_over_tiny_base(tmp_path)
    assert resolve_with_adapter(adapter) == (tiny_base_path, adapter)
    assert resolve_with_adapter("tiny-base") == (tiny_base_path, None)
    argv, _ = ServerSpec(str(adapter), port=free_port(), cpu=True).command()
    assert argv[argv.index("--model-path") + 1] == str(tiny_base_path)
    assert argv[argv.index("--speculative-algorithm") + 1] == "RISD"
    assert argv[argv.index("--selfspec-lora") + 1] == str(adapter)
    with pytest.raises(ServeError, match="is a RISD adapter.*--speculative-algorithm RISD"):
        ServerSpec(str(adapter), port=free_port(), cpu=True, extra_args=["--speculative-algorithm", "ISD"]).command()


def test_adapter_without_a_findable_base_is_one_clear_line(tmp_path):
    from selfspec.models import resolve_with_adapter

    adapter = _adapter_over_tiny_base(tmp_path)
    (adapter / "selfspec.json").write_text(json.dumps({"format_version": 1, "base_model": "no-such-base"}))
    with pytest.raises(ModelNotFoundError, match="the base of adapter .* cannot be found"):
        resolve_with_adapter(adapter)


def test_arguments_after_dashdash_only_for_serve():
    out = _cli("models", "--", "--foo")
    assert out.returncode == 2 and "only accepted by `selfspec serve`" in out.stderr


@pytest.mark.parametrize("flags, message", [
    (["--stride", "1"], "every stride must be >= 2"),
    (["--stride", "4", "--curriculum", "2,5"], "curriculum must end at --stride 4"),
    (["--stride", "4", "--data", "/no/such/corpus.jsonl"], "no such file or directory"),
])
def test_train_idlm_bad_input_is_one_clear_line(tmp_path, flags, message):
    out = _cli("train", "idlm", "--base", "tiny-base", *flags, "--out", str(tmp_path / "out"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("selfspec: ") and message in out.stderr


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--mode", "jacobi", "--temperature", "0.7"], "--mode jacobi is greedy only"),
    (["--mode", "eagle"], "invalid choice: 'eagle'"),
    (["--mode", "isd", "--mode-config", "stride=three"], "isd option stride='three': expected an integer"),
    (["--mode", "sjd", "--mode-config", "windw=2"], "unknown sjd option"),
    (["--mode", "isd", "--mode-config", "stride=1"], "ISD stride must be >= 2"),
])
def test_generate_bad_input_is_one_clear_line(flags, message):
    out = _cli("generate", "--model", "tiny-base", "--prompt", "def f():", *flags)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr


def test_generate_takes_mode_options(monkeypatch, capsys):
    """`--mode isd --mode-config stride=2` decodes with ISD at stride 2 (tiny-idlm's selfspec.json
    says 4): the mode the engine built, and the step widths it ran (2N-1 = 3 query tokens)."""
    from selfspec.cli import main
    from selfspec.decoding.modes.isd import ISDMode
    from selfspec.engines.hf import HFEngine

    built, widths = [], []
    build = HFEngine.build_mode

    def recording_build(self, *args, **kwargs):
        mode = build(self, *args, **kwargs)
        built.append(mode)
        return mode
    layouts = ISDMode.layouts

    def recording_layouts(self, seqs):
        out = layouts(self, seqs)
        widths.extend(len(lay.tokens) for lay in out)
        return out
    monkeypatch.setattr(HFEngine, "build_mode", recording_build)
    monkeypatch.setattr(ISDMode, "layouts", recording_layouts)
    assert main(["generate", "--model", "tiny-idlm", "--prompt", "import os", "--mode", "isd",
                 "--mode-config", "stride=2", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert [(type(m), m.config.stride) for m in built] == [(ISDMode, 2)]
    assert widths and max(widths) == 3, widths
    assert "mode=isd" in err and float(err.split(" tokens per forward")[0].split()[-1]) <= 2  # N tokens a forward
