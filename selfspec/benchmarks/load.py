"""Load generation for `selfspec bench serve`: streamed OpenAI requests in a closed loop of C
workers, their per-request timings, the server's counters before and after, and the prompts
of each level and interleaved round."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from selfspec.benchmarks.repetition import OutputStat, non_loop_summary




# ---------------------------------------------------------------------------------- one level
def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _one_request(client, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool) -> dict:
    t0 = time.perf_counter()
    first = None
    tokens = None
    details = None
    token_ids: list[int] = []
    extra = {"return_spec_tokens_details": True, "return_token_ids": True}
    if ignore_eos:
        extra["ignore_eos"] = True
    stream = client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                       stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.choices:
            choice = chunk.choices[0]
            ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
            if ids:
                token_ids.extend(int(t) for t in ids)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        d = getattr(chunk, "sglext", None) or (chunk.model_extra or {}).get("sglext")
        if d:
            details = d
    end = time.perf_counter()
    first = first or end
    n = int(tokens or 0)
    out = {"e2e": end - t0, "ttft": first - t0, "tokens": n, "token_ids": token_ids if token_ids or not n else None,
           "tpot": (end - first) / (n - 1) if n > 1 else float("nan")}
    spec = None
    if isinstance(details, dict):
        spec = details.get("spec_tokens_details") or details
    if isinstance(spec, dict) and spec.get("spec_verify_ct"):
        out["verify_ct"] = int(spec["spec_verify_ct"])
    return out


def server_stats(base_url: str) -> dict:
    try:
        with urllib.request.urlopen(base_url + "/server_info", timeout=30) as r:
            st = (json.loads(r.read()).get("internal_states") or [{}])[0]
    except Exception:
        return {}
    return {"selfspec": st.get("selfspec"), "avg_spec_accept_length": st.get("avg_spec_accept_length")}


@dataclass
class Chunk:
    """One closed-loop pass of some prompts through a server: what each request returned."""
    results: list[dict]
    errors: list[str]
    wall_s: float
    stats: tuple[int, int] | None = None  # (committed tokens, forwards) the server counted meanwhile
    kinds: dict[str, int] | None = None  # tokens committed meanwhile by each kind of step (own, lookup, ar)


def run_requests(base_url: str, prompts: list[str], concurrency: int, max_tokens: int, temperature: float,
                 ignore_eos: bool) -> Chunk:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=3600)
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    queue = list(prompts)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                p = queue.pop(0)
            try:
                r = _one_request(client, p, max_tokens, temperature, ignore_eos)
                with lock:
                    results.append(r)
            except Exception as e:  # recorded, the level continues
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for _ in range(concurrency):
            ex.submit(worker)
    return Chunk(results, errors, time.perf_counter() - t0)


def loop_split(results: list[dict], has_verify: bool) -> dict:
    """The all / non-looping split of one level's requests (`_one_request` results): the level's
    `per_request_tok_s`, `repetition_loops` and `non_loop` (None without every request's token ids)."""
    latency = sum(r["e2e"] for r in results)
    out: dict[str, Any] = {"per_request_tok_s": sum(r["tokens"] for r in results) / latency if latency > 0 else 0.0,
                           "repetition_loops": None, "non_loop": None}
    if any(r.get("token_ids") is None for r in results):
        return out
    stats = [OutputStat(r["token_ids"], r.get("verify_ct", 0) + 1 if has_verify else None, r["e2e"], r["tokens"])
             for r in results]
    out["repetition_loops"] = sum(o.loops for o in stats)
    out["non_loop"] = non_loop_summary(stats)
    return out


def summarize_level(concurrency: int, chunks: list[Chunk]) -> dict:
    """One level's numbers from the chunks it ran in (one, or one per round of `--interleave`):
    tokens over the summed wall time, latency percentiles over every request."""
    results = [r for ch in chunks for r in ch.results]
    errors = [e for ch in chunks for e in ch.errors]
    wall = sum(ch.wall_s for ch in chunks)
    tokens = sum(r["tokens"] for r in results)
    tpots = [r["tpot"] * 1e3 for r in results if r["tpot"] == r["tpot"]]
    level = {
        "concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "tpot_ms_p50": _percentile(tpots, 0.5), "tpot_ms_p99": _percentile(tpots, 0.99),
        "ttft_ms_p50": _percentile([r["ttft"] * 1e3 for r in results], 0.5),
        "errors": len(errors), "first_error": errors[0] if errors else None,
        # each chunk's own rate: how far the rounds of an interleaved level disagree
        "round_tok_s": [sum(r["tokens"] for r in ch.results) / ch.wall_s if ch.wall_s > 0 else 0.0 for ch in chunks],
    }
    has_verify = any("verify_ct" in r for r in results)  # a request that ended at its prefill reports no details
    if has_verify:
        level["tpf"] = tokens / sum(r.get("verify_ct", 0) + 1 for r in results)
    level.update(loop_split(results, has_verify))
    return level


def kinds_delta(before: dict, after: dict) -> dict[str, int] | None:
    """Tokens a selfspec server committed between two `server_stats` by each kind of step: the
    mode's own steps, lookup steps, plain AR steps (`metrics.AggregateStats.by_kind`)."""
    a, b = (after.get("selfspec") or {}).get("steps_by_kind"), (before.get("selfspec") or {}).get("steps_by_kind")
    if a is None:
        return None
    return {k: v["tokens"] - ((b or {}).get(k) or {}).get("tokens", 0) for k, v in a.items()}


def stats_delta(before: dict, after: dict) -> tuple[int, int] | None:
    """(committed tokens, forwards) a selfspec server counted between two `server_stats`."""
    a, b = after.get("selfspec"), before.get("selfspec")
    if a and b is not None:
        return (a["committed_tokens"] - (b or {}).get("committed_tokens", 0),
                a["forwards"] - (b or {}).get("forwards", 0))
    return None


# ---------------------------------------------------------------------------------- driver
def level_sizes(levels: list[int], num_prompts: int) -> list[int]:
    """Requests per concurrency level: `num_prompts`, or C where C is larger, so a level of
    concurrency C really holds C requests in flight (16 requests at "C=32" would measure C=16)."""
    return [max(num_prompts, c) for c in levels]


def level_prompts(texts: list[str], sizes: list[int], level_index: int) -> list[str]:
    """The prompts of one concurrency level: consecutive windows of the file (cycling), so a mode
    that learns from its own outputs (NGRAM's corpus) does not see the same prompt twice when the
    file is long enough; every mode gets the same window at the same level."""
    start = sum(sizes[:level_index]) % len(texts)
    return [texts[(start + i) % len(texts)] for i in range(sizes[level_index])]


def interleave_chunks(prompts: list[str], rounds: int, concurrency: int) -> list[list[str]]:
    """A level's prompts as `rounds` consecutive chunks of at least C requests each (fewer chunks
    where the level holds fewer than rounds x C: a chunk always fills its concurrency)."""
    n = max(1, min(rounds, len(prompts) // max(1, concurrency)))
    bounds = [round(i * len(prompts) / n) for i in range(n + 1)]
    return [prompts[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def round_order(items: list, round_index: int) -> list:
    """Forward on even rounds, backward on odd ones (A B C, C B A, ...): no mode always runs first."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]
