"""genai-bench, the load generator users run, driven at the same concurrencies as
`selfspec bench serve` (synthetic D(input, output) traffic); its headline numbers go beside ours."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path




# ---------------------------------------------------------------------------------- genai-bench
def genai_bench_available() -> bool:
    return shutil.which("genai-bench") is not None or (Path(sys.executable).parent / "genai-bench").exists()


def run_genai_bench(base_url: str, tokenizer_dir: str, concurrency: list[int], input_tokens: int, max_tokens: int,
                    num_requests: int, workdir: Path, timeout: float = 3600) -> dict[int, dict]:
    """Run genai-bench once over all levels; returns {concurrency: headline metrics}."""
    exe = shutil.which("genai-bench") or str(Path(sys.executable).parent / "genai-bench")
    cmd = [exe, "benchmark", "--api-backend", "openai", "--api-base", base_url, "--api-key", "none",
           "--api-model-name", "default", "--model-tokenizer", tokenizer_dir, "--task", "text-to-text",
           "--traffic-scenario", f"D({max(1, input_tokens)},{max_tokens})", "--server-engine", "SGLang",
           "--max-time-per-run", "5", "--max-requests-per-run", str(num_requests),
           "--experiment-base-dir", str(workdir)]
    for c in concurrency:
        cmd += ["--num-concurrency", str(c)]
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "genai-bench.log", "w") as log:
        subprocess.run(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    out: dict[int, dict] = {}
    for f in workdir.rglob("*.json"):
        try:
            data = json.loads(f.read_text())
        except Exception:
            continue
        agg = data.get("aggregated_metrics") if isinstance(data, dict) else None
        if not isinstance(agg, dict):
            continue
        c = agg.get("num_concurrency") or (data.get("num_concurrency") if isinstance(data, dict) else None)
        if c is None:
            continue
        stats = agg.get("stats") or {}
        tpot = (stats.get("tpot") or {}) if isinstance(stats, dict) else {}
        out[int(c)] = {
            "output_tok_s": agg.get("mean_output_throughput_tokens_per_s"),
            "tpot_ms_p50": (tpot.get("p50") * 1e3) if isinstance(tpot.get("p50"), (int, float)) else None,
            "tpot_ms_p99": (tpot.get("p99") * 1e3) if isinstance(tpot.get("p99"), (int, float)) else None,
            "error_rate": agg.get("error_rate"),
            "file": str(f),
        }
    return out
