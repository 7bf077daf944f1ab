"""run.json in the shape `vllm bench serve --save-result [--save-detailed]` writes its result file (vLLM 0.33).

Every key vLLM 0.33 writes for a generation benchmark is written under its own name, type and unit, read from
``vllm/benchmarks/serve.py``: the setup keys ``date`` ... ``max_concurrency`` (serve.py:2302-2330), the
benchmark's ``duration`` ... ``rtfx`` (serve.py:1320-1342) and the latency statistics
``{mean,median,std,pXX}_{metric}_ms`` (serve.py:1399-1436). ``--save-detailed`` keeps the per-request arrays that
vLLM otherwise drops (serve.py:2428-2443); ``latencies`` and ``queue_times`` are not in vLLM's drop list, so they
are written either way, as vLLM writes them.

What a simulation cannot know as vLLM knows it is said in the file, under ``servetune_notes``, key by key
(``NOTES``): no text is generated, no client semaphore queues requests, and without ``--save-detailed`` the
per-second token peak assumes each request's tokens evenly spaced. The one definition that differs is goodput:
vLLM's ``--goodput`` judges TTFT, TPOT and E2EL against one SLO for every request (serve.py:669-691), servetune's
also each request's largest inter-token gap (``slo.itl_ms``) and tenants' class SLOs; ``request_goodput`` is
servetune's and ``request_goodput_vllm`` vLLM's, from the same run.
"""
from __future__ import annotations

import math
from datetime import datetime
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from servetune.config import SloConfig, WorkloadConfig
from servetune.errors import InvalidValue
from servetune.envs.metrics import statistics
from servetune.envs.sim.outcome import (
    COMPLETED, NOT_ARRIVED, REJECT_MAX_MODEL_LEN, REJECT_QUEUE_FULL, REJECT_TENANT_RATE, REJECTED,
    SimulationOutcome,
)
from servetune.envs.workload.requests import Workload

# vLLM's --percentile-metrics names servetune computes (vLLM also has client_queue_time and
# e2el_including_client_queue, which exist only with its client-side --max-concurrency; serve.py:1848-1857).
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# vLLM's default for generation is "ttft,tpot,itl" (serve.py:2255); servetune reports E2EL too.
DEFAULT_PERCENTILE_METRICS = PERCENTILE_METRICS
# vLLM's own --backend default (serve.py:1648-1653): a simulation has no backend; this names the simulator.
BACKEND = "servetune"

# The arrays vLLM writes only with --save-detailed (serve.py:2428-2443; server_queue_times and server_ttfts
# come from a server's response headers, which a simulation has none of, as a vLLM run without them).
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")

# The reason phrase vLLM's client records as the error of a refused request (``response.reason``, e.g.
# vllm/benchmarks/lib/endpoint_request_func.py), by why servetune rejected it.
_REJECT_ERRORS = {
    REJECT_MAX_MODEL_LEN: "Bad Request (servetune: prompt + output beyond max_model_len, HTTP 400)",
    REJECT_QUEUE_FULL: "Service Unavailable (servetune: max_num_queued_reqs reached, HTTP 503)",
    REJECT_TENANT_RATE: "Too Many Requests (servetune: the tenant's rate limit, HTTP 429)",
}
UNFINISHED_ERROR = "servetune: unfinished, the run's horizon (simulation.horizon_s) ended before its last token"

NOTES = {
    "goodput": ("request_goodput is servetune's: completed requests meeting every SLO of the config -- ttft_ms, "
                "tpot_ms, e2el_ms and itl_ms (each request's largest inter-token gap), each request judged by its "
                "tenant's class SLO where one is set -- per second. vLLM's --goodput takes ttft, tpot and e2el only, "
                "one SLO for all requests, and writes null without it (serve.py:669-691, 1326). "
                "request_goodput_vllm is vLLM's definition on the same run with the config's slo ttft_ms, "
                "tpot_ms and e2el_ms (null when it sets none of them); goodput_vllm_args is the --goodput that "
                "asks vLLM for it."),
    "num_prompts": "the requests that arrived before the horizon: completed + failed, the length of the arrays",
    "failed": "rejected requests (errors says why, as the HTTP status vLLM's server or a gateway would answer) "
              "plus requests unfinished at the run's horizon",
    "request_rate": "the configured rate of a poisson or gamma arrival process; for any other process (traces, "
                    "on/off, piecewise, tenants' own, closed-loop sessions) the run's mean arrival rate, "
                    "(arrived - 1) / (last arrival - first arrival), and burstiness null: vLLM has no such process",
    "max_concurrency": "always null: servetune models no client-side concurrency limit",
    "start_times": "each request's arrival on the workload's clock, in seconds (vLLM: time.perf_counter() when "
                   "sent)",
    "queue_times": "always 0.0: no client-side semaphore delays a request",
    "generated_texts": "empty strings: a simulation generates no text",
    "failed_requests": "a failed request has ttft 0.0, latency 0.0, no itls and output_len 0",
    "itls": "each request's own inter-token gaps in seconds, from servetune's reference simulator "
            "(envs/sim/reference.py) run on the same workload and config, since the JAX engine keeps only each "
            "request's largest gap; itls_max_mismatch_s is the largest |ttft + sum(itls) - latency| between it "
            "and the JAX run the other keys come from",
    "itl_percentiles": "pooled ITL percentiles come from the engine's log-spaced gap histogram (exact to ~0.5%); "
                       "mean and std are exact",
    "servetune_slots": "with --save-detailed: the seats of the running batch over time, from the same reference "
                       "run as itls: each interval is one request on one seat, prefilling (a prompt chunk or a "
                       "recompute) or decoding, in the steps it was scheduled; seat_limit is max_num_seqs "
                       "(batch_size for static batching), seats the most held at once (envs/timeline.py)",
    "servetune_timeline": "with --save-detailed: waiting requests (the queue), running requests and KV blocks "
                          "held, from the same reference run, in bins of bin_s seconds on the workload's clock "
                          "from from_s to to_s: each bin's time-weighted mean and its maximum "
                          "(envs/timeline.py)",
    "max_output_tokens_per_s": "vLLM's per-second bucketing (serve.py:700-753); without --save-detailed each "
                               "request's tokens are taken as evenly spaced between its first and last token, "
                               "with --save-detailed their exact times (itls) are used",
}


def parse_percentiles(text: str, flag: str = "--metric-percentiles") -> tuple[float, ...]:
    """vLLM's ``--metric-percentiles`` ("50,90,99", serve.py:1859-1866, 2284): percentiles in [0, 100], kept in
    the order given, repeats dropped; a UserError naming ``flag`` otherwise."""
    expected = "comma-separated percentiles from 0 to 100, such as 50,90,99"
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise InvalidValue(flag, text, expected) from None
    if not all(0 <= value <= 100 for value in values):
        raise InvalidValue(flag, text, expected)
    return tuple(dict.fromkeys(values))


def parse_percentile_metrics(text: str, flag: str = "--percentile-metrics") -> tuple[str, ...]:
    """vLLM's ``--percentile-metrics`` ("ttft,tpot,itl", serve.py:1848-1857, 2263), of the metrics servetune
    computes; a UserError naming ``flag`` otherwise (vLLM's client-queue metrics need its --max-concurrency)."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    if not names or not all(name in PERCENTILE_METRICS for name in names):
        raise InvalidValue(flag, text, f"comma-separated names among {', '.join(PERCENTILE_METRICS)}")
    return names


def request_rate_and_burstiness(config: WorkloadConfig, outcome: SimulationOutcome
                                ) -> tuple[Union[float, str], Optional[float]]:
    """vLLM's ``request_rate`` (a number, or "inf" when every request is sent at once; serve.py:2326-2328) and
    ``burstiness`` (the gamma shape of the gaps, 1.0 for Poisson; serve.py:468-508) of the run's arrivals."""
    arrivals = config.arrivals
    own_process = config.tenant_arrivals or config.sessions is not None
    if not own_process and arrivals.kind in ("poisson", "gamma") and arrivals.rate is not None:
        # A gamma process with coefficient of variation cv has shape 1 / cv^2: vLLM's burstiness.
        burstiness = 1.0 if arrivals.kind == "poisson" or arrivals.cv is None else 1.0 / float(arrivals.cv) ** 2
        return float(arrivals.rate), burstiness
    if not own_process and arrivals.kind == "vllm" and arrivals.ramp_up is None:
        # The flags themselves: an unset rate is vLLM's inf (every request at 0).
        rate = arrivals.request_rate
        burstiness = 1.0 if arrivals.burstiness is None else float(arrivals.burstiness)   # vLLM's default
        return ("inf" if rate is None or math.isinf(rate) else float(rate)), burstiness
    times = np.sort(outcome.requests.arrival_s[outcome.requests.status != NOT_ARRIVED])
    span = float(times[-1] - times[0]) if times.size else 0.0
    return ((len(times) - 1) / span if span > 0 else "inf"), None


def vllm_request_goodput(outcome: SimulationOutcome, slo: SloConfig, duration_s: float) -> Optional[float]:
    """Goodput as ``vllm bench serve --goodput`` computes it (serve.py:669-691, 779): completed requests whose
    TTFT, TPOT (0 for a one-token request) and E2EL are each within ``slo``'s, per second of ``duration_s``;
    no ITL criterion and one SLO for every request. None when ``slo`` sets none of the three, as vLLM writes
    null without ``--goodput``."""
    limits = {name: getattr(slo, f"{name}_ms") for name in ("ttft", "tpot", "e2el")}
    if all(limit is None for limit in limits.values()) or not duration_s > 0:
        return None
    req = outcome.requests
    completed = req.status == COMPLETED
    ttft = (req.first_token_s - req.arrival_s)[completed]
    e2el = (req.finish_s - req.arrival_s)[completed]
    out = req.generated_tokens[completed]
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (e2el - ttft) / (out - 1), 0.0)
    good = np.ones(len(ttft), dtype=bool)
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        if limits[name] is not None:
            good &= limits[name] / 1000.0 >= values   # vLLM: ``s >= r`` with the SLO in seconds
    return int(good.sum()) / duration_s


def goodput_args(slo: SloConfig) -> Optional[str]:
    """The ``vllm bench serve --goodput`` value asking vLLM for ``request_goodput_vllm``, e.g. "ttft:800 e2el:5000"."""
    pairs = [f"{name}:{getattr(slo, f'{name}_ms'):g}" for name in ("ttft", "tpot", "e2el")
             if getattr(slo, f"{name}_ms") is not None]
    return " ".join(pairs) or None


def peak_output_tokens_and_concurrency(start_s: np.ndarray, latency_s: np.ndarray,
                                       token_times: Iterator[np.ndarray]) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests`` (serve.py:700-753) over the successful
    requests: their start times, latencies, and (in chunks, to bound memory) the absolute times of all their
    tokens. Seconds are bucketed from the earliest start; a request counts as concurrent in every second from
    its start's to its end's, both included. Both maxima are taken separately, as vLLM takes them."""
    if len(start_s) == 0:
        for _ in token_times:
            pass
        return 0.0, 0
    start_s, latency_s = np.asarray(start_s, np.float64), np.asarray(latency_s, np.float64)
    min_start = float(start_s.min())
    num_seconds = int(np.ceil(float((start_s + latency_s).max()) - min_start)) + 1
    tokens = np.zeros(num_seconds, dtype=np.int64)
    for times in token_times:
        # int() truncates towards zero as vLLM's ``int(token_time - min_start_time)`` does; buckets outside
        # [0, num_seconds) are dropped, as vLLM drops them.
        buckets = np.trunc(np.asarray(times, np.float64) - min_start)
        buckets = buckets[(buckets >= 0) & (buckets < num_seconds)].astype(np.int64)
        tokens += np.bincount(buckets, minlength=num_seconds)
    first = np.trunc(start_s - min_start).astype(np.int64)
    last = np.trunc(start_s + latency_s - min_start).astype(np.int64)
    change = np.zeros(num_seconds + 1, dtype=np.int64)
    np.add.at(change, first, 1)
    np.add.at(change, last + 1, -1)
    return float(tokens.max()), int(np.cumsum(change)[:num_seconds].max())


def _even_token_times(first_s: np.ndarray, finish_s: np.ndarray, tokens: np.ndarray,
                      chunk_tokens: int = 1 << 22) -> Iterator[np.ndarray]:
    """Each request's token times taken as evenly spaced from its first token to its last, in chunks of about
    ``chunk_tokens`` tokens (a request with more is a chunk of its own)."""
    tokens = np.asarray(tokens, np.int64)
    cumulative = np.cumsum(tokens)
    start = 0
    while start < len(tokens):
        before = int(cumulative[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(cumulative, before + chunk_tokens, side="right")))
        counts = tokens[start:stop]
        first, finish = first_s[start:stop], finish_s[start:stop]
        step = np.where(counts > 1, (finish - first) / np.maximum(counts - 1, 1), 0.0)
        owner = np.repeat(np.arange(len(counts)), counts)
        k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        yield first[owner] + k * step[owner]
        start = stop


def _exact_token_times(start_s: np.ndarray, ttft_s: np.ndarray, itls: Sequence[Sequence[float]]
                       ) -> Iterator[np.ndarray]:
    """Token times as vLLM rebuilds them: ``start + ttft``, then one gap after another (serve.py:730-735)."""
    for start, ttft, gaps in zip(start_s, ttft_s, itls):
        yield start + ttft + np.concatenate([[0.0], np.cumsum(np.asarray(gaps, np.float64))])


def _error(status: int, reason: int) -> str:
    if status == COMPLETED:
        return ""
    if status == REJECTED:
        return _REJECT_ERRORS.get(reason, "servetune: rejected")
    return UNFINISHED_ERROR


def vllm_result(workload: Workload, outcome: SimulationOutcome, metrics: dict, *, workload_config: WorkloadConfig,
                slo: SloConfig, model_id: str, label: Optional[str] = None,
                percentiles: Sequence[float], percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                request_itls: Optional[list[list[float]]] = None, date: Optional[datetime] = None) -> dict:
    """The run as `vllm bench serve --save-result` writes it, in vLLM's key order, from servetune's
    ``compute_metrics`` (``metrics``, computed with the same ``percentiles``).

    ``request_itls`` (each request's gaps in seconds, in workload order; ``servetune.pipeline.request_itls``)
    makes it ``--save-detailed``'s: the per-request arrays are added and the token peak is exact.
    """
    req = outcome.requests
    rows = np.flatnonzero(req.status != NOT_ARRIVED)
    status, reason = req.status[rows], req.reject_reason[rows]
    ok = status == COMPLETED
    arrival = req.arrival_s[rows]
    ttft = np.where(ok, req.first_token_s[rows] - arrival, 0.0)
    latency = np.where(ok, req.finish_s[rows] - arrival, 0.0)
    output_lens = np.where(ok, req.generated_tokens[rows], 0)
    request_rate, burstiness = request_rate_and_burstiness(workload_config, outcome)

    if request_itls is None:
        token_times = _even_token_times(req.first_token_s[rows][ok], req.finish_s[rows][ok], output_lens[ok])
    else:
        itls = [list(map(float, request_itls[i])) if good else [] for i, good in zip(rows, ok)]
        token_times = _exact_token_times(arrival[ok], ttft[ok], [g for g, good in zip(itls, ok) if good])
    peak_tokens, peak_concurrency = peak_output_tokens_and_concurrency(arrival[ok], latency[ok], token_times)

    result: dict = {
        "date": (date or datetime.now()).strftime("%Y%m%d-%H%M%S"),   # serve.py:2305
        "endpoint_type": BACKEND,
        "backend": BACKEND,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": model_id,   # vLLM's default: the model's own tokenizer (serve.py:2142)
        "num_prompts": int(len(rows)),
        "request_rate": request_rate,
        "burstiness": burstiness,
        "max_concurrency": None,
        "duration": metrics["duration"],
        "completed": metrics["completed"],
        "failed": int((~ok).sum()),
        "total_input_tokens": metrics["total_input_tokens"],
        "total_output_tokens": metrics["total_output_tokens"],
        "request_throughput": metrics["request_throughput"],
        "request_goodput": metrics["request_goodput"],
        "output_throughput": metrics["output_throughput"],
        "total_token_throughput": metrics["total_token_throughput"],
    }
    if request_itls is not None:
        result.update({
            "input_lens": [int(x) for x in workload.prompt_tokens[rows]],
            "output_lens": [int(x) for x in output_lens],
            "ttfts": [float(x) for x in ttft],
            "itls": itls,
        })
    result["latencies"] = [float(x) for x in latency]
    if request_itls is not None:
        result["start_times"] = [float(x) for x in arrival]
    result["queue_times"] = [0.0] * len(rows)
    if request_itls is not None:
        result["generated_texts"] = [""] * len(rows)
        result["errors"] = [_error(int(s), int(r)) for s, r in zip(status, reason)]
    result.update({"max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_concurrency,
                   "rtfx": 0.0})
    for name in percentile_metrics:
        for stat in statistics(percentiles):
            result[f"{stat}_{name}_ms"] = metrics[f"{stat}_{name}_ms"]

    result["request_goodput_vllm"] = vllm_request_goodput(outcome, slo, metrics["duration"] or 0.0)
    result["goodput_vllm_args"] = goodput_args(slo)
    if request_itls is not None:
        sums = np.array([sum(g) for g in itls])
        result["itls_max_mismatch_s"] = float(np.abs(ttft + sums - latency)[ok].max()) if ok.any() else 0.0
    notes = dict(NOTES)
    if request_itls is None:
        for key in ("itls", "servetune_slots", "servetune_timeline"):
            del notes[key]
    result["servetune_notes"] = notes
    return result


def itl_mismatch_warning(result: dict, tolerance_s: float = 1e-3) -> Optional[str]:
    """A warning when the reference simulator's gaps disagree with the JAX run by more than ``tolerance_s``."""
    mismatch = result.get("itls_max_mismatch_s")
    if mismatch is None or not mismatch > tolerance_s or math.isnan(mismatch):
        return None
    return (f"the reference simulator's inter-token gaps (itls) differ from the JAX run by up to {mismatch:.6f} s "
            f"in a request's end-to-end latency; please report it with the config")
