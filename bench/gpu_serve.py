#!/usr/bin/env python
"""GPU check of the selfspec SGLang plugin, one command for one device call:

    python bench/gpu_serve.py [--model tiny-base] [--modes ar,ngram,isd,risd,jacobi,sjd]
                              [--prompts 16] [--max-new-tokens 64] [--dtype bfloat16] [--json OUT.json]
                              [--tp-size 2] [--dp-size 2]   # on a machine with that many GPUs

For each mode it launches stock SGLang (`python -m sglang.launch_server`) with CUDA graphs on
(SGLang's default on CUDA; the fixed-width TARGET_VERIFY forward of every selfspec mode is
captured by SGLang's decode CUDA-graph runner), then
  * checks that the target-verify graphs were captured and used (server log),
  * sends the held-out prompts greedily, sequentially and as one concurrent burst, and compares
    the output token for token with the AR server's (ISD / RISD / JACOBI / greedy SJD are
    lossless); a mismatch is classified with the HF float32 reference: a "knife edge" when the
    AR logits' top-2 margin at that position is below --tie-margin (a bf16 rounding difference
    between the decode and verify kernels), a real failure otherwise;
  * prints TPF (from the response meta_info) and output tok/s at concurrency 1 and 16.
Exits non-zero on a real mismatch or a server that fails to start.

Self-contained: needs torch with CUDA and sglang in the interpreter running it, nothing else
installed. When the selfspec plugin is not installed as a package, the script exposes this
checkout's `sglang.srt.plugins` entry point to every SGLang process through a generated
dist-info directory on PYTHONPATH. RISD runs with the embedded tiny-idlm-lora adapter when the
model is tiny-base (a trained adapter: realistic TPF), else with a randomly initialised LoRA
adapter saved over the model (needs peft; skipped otherwise): gated to [MASK] positions, it must
not change greedy output. Logs and the JSON summary go to --out-dir (default $OUT, else a temp dir).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: GPU settings beside each mode's algorithm flag (wider windows pay on a GPU)
GPU_OPTIONS = {
    "jacobi": ["--selfspec-options", "block_size=16,max_blocks=2,verify_size=4"],
    "sjd": ["--selfspec-options", "window=6"],
}
LOSSLESS = {"isd", "risd", "jacobi", "sjd"}


def log(msg: str) -> None:
    print(f"[gpu_serve] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plugin_env(out_dir: Path) -> dict:
    """Environment for SGLang processes: this checkout importable and its plugin discoverable."""
    env = dict(os.environ)
    paths = [str(REPO)]
    have = any(ep.value.startswith("selfspec.") for ep in importlib.metadata.entry_points(group="sglang.srt.plugins"))
    if not have:
        shim = out_dir / "entry_point_shim"
        dist = shim / "selfspec_gpu_serve-0.0.0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: selfspec-gpu-serve\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nselfspec = selfspec.sglang_ext.plugin:register\n")
        paths.append(str(shim))
        log(f"selfspec plugin not installed: exposing {REPO} through {shim}")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


class Server:
    def __init__(self, name: str, model: Path, args: list[str], env: dict, out_dir: Path):
        self.name, self.port = name, free_port()
        self.log_path = out_dir / f"server-{name}.log"
        self.argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), *args]
        self.env = env
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> float:
        t0 = time.time()
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - t0
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name}: not healthy within {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if getattr(self, "log_file", None):
            self.log_file.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def generate(url: str, ids: list[int], max_new: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def burst(url: str, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda ids: generate(url, ids, max_new), prompts))
    return outs, time.perf_counter() - t0


def embedded_adapter_for(model: Path) -> Path | None:
    """tiny-idlm-lora when `model` is the base it was trained on (same weights hash)."""
    from selfspec.models import ASSETS_DIR
    from selfspec.checkpoints.metadata import weights_sha256 as checkpoint_sha256

    adapter = ASSETS_DIR / "tiny-idlm-lora"
    meta_file = adapter / "selfspec.json"
    if not meta_file.exists():
        return None
    recorded = json.loads(meta_file.read_text()).get("lora", {}).get("base_sha256")
    return adapter if recorded == checkpoint_sha256(model) else None


def make_random_lora(model: Path, out: Path) -> Path | None:
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        log(f"RISD skipped: {e}")
        return None
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(base, cfg).save_pretrained(str(out))
    from selfspec.checkpoints.metadata import write_metadata
    from selfspec.checkpoints.metadata import weights_sha256 as checkpoint_sha256

    write_metadata(out, {"mode": "RISD", "base_model": str(model),
                         "lora": {"rank": 8, "base_sha256": checkpoint_sha256(model)}})
    return out


def graph_capture_seconds(log_text: str, kind: str) -> float | None:
    """Seconds SGLang spent capturing `kind` CUDA graphs ("decode", "target_verify"), from its
    "Engine startup timings" line; 0 when nothing was captured."""
    import re

    m = re.search(rf"cuda_graph=\{{[^}}]*\b{kind}=([0-9.]+)", log_text)
    return float(m.group(1)) if m else None


def tie_margin_at(model: Path, prompt: list[int], prefix: list[int], cache: dict) -> float:
    """Top-2 logit margin of the HF float32 model after prompt + prefix (a knife edge when small)."""
    import torch
    from transformers import AutoModelForCausalLM

    if "model" not in cache:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        cache["model"] = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        x = torch.tensor([prompt + prefix], device=next(cache["model"].parameters()).device)
        top = cache["model"](x).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-base")
    ap.add_argument("--modes", default="ar,ngram,isd,risd,jacobi,sjd")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default=None, help="default: SGLang's choice for the GPU")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor parallelism of every server (needs that many GPUs)")
    ap.add_argument("--dp-size", type=int, default=1, help="data parallelism of every server (needs that many GPUs)")
    ap.add_argument("--tie-margin", type=float, default=0.05)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="exercise this script on a CPU machine (CPU flags, no CUDA graphs): checks the script, "
                    "not the GPU path")
    args = ap.parse_args()

    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="gpu_serve-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.cpu_dry_run:
        log("no CUDA device: this script checks the GPU path (CUDA graphs); run the CPU tests instead")
        return 2
    try:
        sglang_version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        log("sglang is not installed in this interpreter: pip install 'selfspec[gpu]' (sglang==0.5.23)")
        return 2
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)"
    log(f"torch {torch.__version__}, sglang {sglang_version}, {device_name}")

    from transformers import AutoTokenizer

    from selfspec.benchmarks.serve import mode_server_args
    from selfspec.models import resolve_model
    from selfspec.prompts import HELDOUT_PROMPTS

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model))
    texts = [json.loads(line)["prompt"] for line in HELDOUT_PROMPTS.read_text().splitlines()
             if line.strip()][: args.prompts]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    env = plugin_env(out_dir)
    common = ["--dtype", args.dtype, "--mem-fraction-static", "0.5", "--max-running-requests", "16",
              "--disable-radix-cache"]
    if device == "cuda":
        common += ["--cuda-graph-max-bs", "16"]
    else:  # dry run: SGLang's CPU engine (see selfspec.serving)
        env.update(SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        common += ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "65536",
                   "--skip-server-warmup"]
    if args.attention_backend:
        common += ["--attention-backend", args.attention_backend]
    if args.tp_size > 1 or args.dp_size > 1:  # every mode, RISD's sharded adapter included
        common += ["--tp-size", str(args.tp_size), "--dp-size", str(args.dp_size)]

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "ar" not in modes:
        modes.insert(0, "ar")
    modes.remove("ar")
    modes.insert(0, "ar")
    summary = {"model": str(model), "dtype": args.dtype, "device": device_name,
               "sglang": sglang_version, "modes": {}}
    reference = None
    failed = False
    tie_cache: dict = {}
    for mode in modes:
        extra = mode_server_args(mode) + GPU_OPTIONS.get(mode, [])
        if mode == "risd":
            adapter = embedded_adapter_for(model) or make_random_lora(model, out_dir / "risd-adapter")
            if adapter is None:
                summary["modes"][mode] = {"status": "skipped", "reason": "peft missing"}
                continue
            extra += ["--selfspec-lora", str(adapter)]
        server = Server(mode, model, common + extra, env, out_dir)
        row: dict = {"status": "ok"}
        try:
            row["startup_s"] = server.start(args.startup_timeout)
            seq = [generate(server.url, p, args.max_new_tokens) for p in prompts]
            outs16, wall16 = burst(server.url, prompts, args.max_new_tokens, 16)
            outs1, wall1 = burst(server.url, prompts[:4], args.max_new_tokens, 1)
            row["tok_s_c1"] = sum(o["meta_info"]["completion_tokens"] for o in outs1) / wall1
            row["tok_s_c16"] = sum(o["meta_info"]["completion_tokens"] for o in outs16) / wall16
            metas = [o["meta_info"] for o in seq]
            verify = sum(m.get("spec_verify_ct", 0) for m in metas)
            tokens = sum(m["completion_tokens"] for m in metas)
            row["tpf"] = tokens / (verify + len(metas)) if verify else 1.0
            text = server.log_text()
            row["cuda_graph_capture_s"] = graph_capture_seconds(text, "decode" if mode == "ar" else "target_verify")
            row["cuda_graph_captured"] = (row["cuda_graph_capture_s"] or 0) > 0
            row["cuda_graph_used"] = "cuda graph: True" in text
            ids_seq = [o["output_ids"] for o in seq]
            ids_burst = [o["output_ids"] for o in outs16]
            if mode == "ar":
                reference = ids_seq
                row["burst_equals_sequential"] = ids_burst == ids_seq
            elif mode in LOSSLESS and reference is not None:
                exact, ties, real = 0, 0, []
                for i, (ref, a, b) in enumerate(zip(reference, ids_seq, ids_burst)):
                    for got in (a, b):
                        if got == ref:
                            exact += 1
                            continue
                        k = next((j for j, (x, y) in enumerate(zip(got, ref)) if x != y), min(len(got), len(ref)))
                        margin = tie_margin_at(model, prompts[i], ref[:k], tie_cache)
                        if margin < args.tie_margin:
                            ties += 1
                        else:
                            real.append((i, k, margin))
                row.update(exact=exact, of=2 * len(prompts), knife_edges=ties, real_mismatches=len(real))
                if real:
                    row["status"] = "MISMATCH"
                    row["first_real_mismatch"] = {"prompt": real[0][0], "token": real[0][1], "margin": real[0][2]}
                    failed = True
        except Exception as e:
            row = {"status": "error", "reason": str(e)}
            failed = True
        finally:
            server.stop()
        summary["modes"][mode] = row
        log(f"{mode:7s} {json.dumps(row)}")

    log("mode     status     TPF   tok/s C=1  tok/s C=16  exact     graphs")
    for mode, row in summary["modes"].items():
        if row.get("status") in ("error", "skipped"):
            log(f"{mode:8s} {row['status']}: {row.get('reason', '')[:200]}")
            continue
        exact = f"{row.get('exact', '-')}/{row.get('of', '-')}" if "exact" in row else "ref"
        log(f"{mode:8s} {row['status']:9s} {row['tpf']:5.2f} {row['tok_s_c1']:10.1f} {row['tok_s_c16']:11.1f}  "
            f"{exact:8s}  captured={row.get('cuda_graph_captured')} used={row.get('cuda_graph_used')}")
    path = Path(args.json) if args.json else out_dir / "gpu_serve.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
