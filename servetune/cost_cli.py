"""The cost-model subcommands: ``cost``, ``memory``, ``calibrate``, ``models``, ``gpus``.

``register(subparsers)`` adds them to the main ``servetune`` parser; each handler takes the parsed
arguments and returns the exit code. User mistakes raise ``UserError`` for the main CLI to print. JAX, SciPy
and the calibration code are imported by the handlers that use them, so that ``servetune --help`` and the
catalogues start without them.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from servetune.config import HardwareConfig, SchedulerConfig
from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.gpus import GIB, GPU_ALIASES, GPUS, GpuSpec
from servetune.cost_models.memory import kv_capacity
from servetune.cost_models.models import KV_CACHE_DTYPES, MODELS, QUANTIZATION_METHODS
from servetune.cost_models.sharding import NoExperts
from servetune.errors import InvalidValue, UserError, unforced_fit_problems
from servetune.paths import check_output_file

DEFAULT_MODEL = "llama-2-7b"
GPU_FLAG_HELP = "a catalogue GPU name (servetune gpus) or the path of a .yaml/.yml/.json file defining one"


def register(subparsers: argparse._SubParsersAction) -> None:
    cost = subparsers.add_parser("cost", help="time one engine step with the roofline model, with its breakdown")
    _add_model_and_gpu(cost)
    cost.add_argument("--decode-batch", type=int, default=0, help="decoding requests in the step (default 0)")
    cost.add_argument("--context", type=int, default=1024,
                      help="tokens already in each decoding request's KV cache (default 1024)")
    cost.add_argument("--prefill-tokens", type=int, default=0,
                      help="tokens of one new prompt prefilled in the step (default 0)")
    cost.add_argument("--profile", help="a calibrated profile (JSON) instead of the default efficiencies")
    cost.add_argument("--scheduling", choices=("async", "sync"), default="async",
                      help="async: the host work of a step overlaps the previous GPU step, so a step takes "
                           "max(GPU, host) (vLLM 0.33's default); sync: GPU + host (default %(default)s)")
    cost.add_argument("--max-cudagraph-capture-size", type=int, metavar="TOKENS",
                      help="steps of more tokens run eagerly, paying a launch cost per kernel; 0 = enforce_eager "
                           "(default: vLLM 0.33's, min(512, 2 x max_num_seqs, max_num_batched_tokens) = "
                           f"{_default_capture_size()})")
    _add_precision(cost)
    _add_expert_parallel(cost)
    cost.add_argument("--expert-load-imbalance", type=float, default=0.0, metavar="FRACTION",
                      help="with --enable-expert-parallel: the busiest GPU gets this much more than its mean share "
                           "of routed tokens (default 0: uniform routing)")
    cost.add_argument("--json", action="store_true", help="print one JSON object")
    cost.set_defaults(func=run_cost)

    memory = subparsers.add_parser(
        "memory", help="KV-cache capacity as vLLM sizes it",
        description="KV-cache capacity as vLLM sizes it: weights, activation reserve, KV bytes per token, blocks. "
                    "It reads no config file: each flag stands for a config key (--tp for hardware.tp, "
                    "--kv-cache-dtype for kv_cache_dtype, --enable-expert-parallel for "
                    "hardware.enable_expert_parallel), and a flag left out takes that key's default.")
    _add_model_and_gpu(memory)
    scheduler = SchedulerConfig()
    memory.add_argument("--gpu-memory-utilization", type=float, default=HardwareConfig().gpu_memory_utilization,
                        help="share of GPU memory the engine may use (default %(default)s)")
    memory.add_argument("--block-size", type=int, default=scheduler.block_size,
                        help="tokens per KV block (default %(default)s)")
    memory.add_argument("--max-num-batched-tokens", type=int, default=scheduler.max_num_batched_tokens,
                        help="token budget per step, sizes the activation reserve (default %(default)s)")
    memory.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs,
                        help="most running requests, sizes the sampler's reserve (default %(default)s)")
    _add_precision(memory)
    _add_expert_parallel(memory)
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    memory.set_defaults(func=run_memory)

    fit = subparsers.add_parser("calibrate", help="fit the roofline's efficiencies to measured GPU timings",
                                description="Fit the roofline's efficiencies and overheads either to measured "
                                            "engine steps (--steps, with --model, --gpu, --tp) or to Vidur/DistServe "
                                            "operator profiles (--profiles, --attention, ...), print the k-fold "
                                            "held-out error, and write a profile for cost_model: {kind: calibrated}.")
    fit.add_argument("--steps", type=Path, metavar="CSV",
                     help="measured engine steps, one a row: prefill_tokens, decode_requests, context_tokens, "
                          "step_time_ms (optional cached_prefix_tokens, prefill_requests)")
    fit.add_argument("--bench", type=Path, metavar="JSON",
                     help="instead of --steps: a `vllm bench serve --save-result --save-detailed` result, whose "
                          "requests are replayed under --config and the latencies fitted (search/calibrate_bench.py)")
    fit.add_argument("--config", type=Path, metavar="YAML",
                     help="with --bench: the deployment the benchmark ran (model, GPU, TP, scheduler)")
    fit.add_argument("--trials", type=int, metavar="N",
                     help="with --bench: candidates each CMA-ES fit simulates (default 160)")
    fit.add_argument("--model", help="with --steps: the model the steps ran (catalogue name or config.json)")
    fit.add_argument("--tp", type=int, default=1, help="with --steps: tensor-parallel GPUs (default 1)")
    fit.add_argument("--fit", metavar="NAMES",
                     help="with --steps: comma-separated parameters to fit (default: those the steps identify)")
    fit.add_argument("--token-tile", type=int, metavar="TOKENS",
                     help="with --steps: fix the matmul token tile, the rows of a GEMM tile (default: the "
                          "best fit of 1, 16, 32, 64, 128 and 256)")
    fit.add_argument("--split-kv", action="store_true",
                     help="with --steps: the engine switches decode attention to a split-KV kernel below a "
                          "batch size (vLLM before 0.3's paged attention V2, docs/cost-models.md): fit the "
                          "switch's threshold and the kernel's efficiency too")
    fit.add_argument("--gpu-time-only", action="store_true",
                     help="with --steps: the times are GPU kernel time (a profiler's sum), without host time")
    fit.add_argument("--async-scheduling", action="store_true",
                     help="with --steps: the steps ran with async scheduling, so each took max(GPU, host) time")
    fit.add_argument("--initial", metavar="PROFILE",
                     help="start from this profile and keep what the data cannot fit from it (default: with "
                          "--steps, the shipped profile of --gpu if there is one; else the datasheet defaults)")
    fit.add_argument("--force", action="store_true",
                     help="with --steps: write the profile even when the fit did not converge or its held-out "
                          "error is worse than the uncalibrated roofline's")
    fit.add_argument("--profiles", nargs="+", default=[], type=Path, metavar="DIR",
                     help="Vidur compute profile folders (each holding mlp.csv)")
    fit.add_argument("--attention", type=Path, help="Vidur attention CSV")
    fit.add_argument("--allreduce", type=Path, help="Vidur network all_reduce.csv")
    fit.add_argument("--cpu-overheads", type=Path, help="Vidur cpu_overheads.csv")
    fit.add_argument("--distserve", type=Path, help="DistServe profiler JSON (fitted step coefficients)")
    fit.add_argument("--gpu", default="a100-80gb",
                     help=f"the GPU the timings were measured on: {GPU_FLAG_HELP} (default %(default)s)")
    fit.add_argument("--step-tp", type=int, default=1,
                     help="tensor parallelism of the whole steps assembled from the profiles (default %(default)s)")
    fit.add_argument("--folds", type=int, default=5, help="k of the k-fold accuracy report (default %(default)s)")
    fit.add_argument("--seed", type=int, default=0, help="seed of the fold assignment (default %(default)s)")
    fit.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    fit.add_argument("--json", action="store_true", help="print the accuracy report as JSON")
    fit.set_defaults(func=run_calibrate)

    models = subparsers.add_parser("models", help="the model catalogue")
    models.add_argument("--json", action="store_true", help="print JSON")
    models.set_defaults(func=run_models)
    gpus = subparsers.add_parser("gpus", help="the GPU catalogue")
    gpus.add_argument("--json", action="store_true", help="print JSON")
    gpus.set_defaults(func=run_gpus)


def _resolve_gpu_flag(value: str) -> GpuSpec:
    """``--gpu``: a catalogue name, or a file defining a GPU as ``hardware.gpu`` may (docs/config.md), read from
    the current folder."""
    from servetune.config_loader import names_gpu_file, read_gpu_file

    if not names_gpu_file(value):
        return resolve_gpu(value)
    try:
        return resolve_gpu(read_gpu_file(value))
    except UserError as error:   # its lines start with the file's path
        raise UserError(*(f"--gpu {line}" for line in error.lines)) from None


def _default_capture_size() -> int:
    """vLLM 0.33's default max_cudagraph_capture_size at servetune's default scheduler limits (the same rule as
    ``roofline.vllm_cudagraph_capture_size``, repeated here so that ``--help`` does not import JAX)."""
    scheduler = SchedulerConfig()
    return min(512, 2 * scheduler.max_num_seqs, scheduler.max_num_batched_tokens)


def _add_precision(parser: argparse.ArgumentParser) -> None:
    """vLLM's --quantization and --kv-cache-dtype, as the config's quantization and kv_cache_dtype keys. The values
    are checked where the config's are, by ``models.with_serving_options`` (through ``resolve_model``), so that a
    bad one is the same one-line error naming the flag, not argparse's usage text."""
    parser.add_argument("--quantization", metavar="{" + ",".join(QUANTIZATION_METHODS) + "}",
                        help="the weights' format when the model's config.json names none (fp8: quantised on "
                             "loading; awq, gptq: a 4-bit checkpoint of the model); default: its config.json's")
    parser.add_argument("--kv-cache-dtype", metavar="{" + ",".join(KV_CACHE_DTYPES) + "}", default="auto",
                        help="the KV cache's dtype: auto is the model's, the fp8 ones a byte per value "
                             "(default %(default)s)")


def _add_expert_parallel(parser: argparse.ArgumentParser) -> None:
    """vLLM's --enable-expert-parallel, as the config's hardware.enable_expert_parallel key."""
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE models: each GPU holds whole experts instead of a slice of each (vLLM's flag)")


def _add_model_and_gpu(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="catalogue name or path of a Hugging Face config.json (default %(default)s)")
    parser.add_argument("--gpu", default=HardwareConfig().gpu, help=f"{GPU_FLAG_HELP} (default %(default)s)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")


# The flag each value that the catalogue and the memory model check came from.
FLAGS = {"model": "--model", "GPU": "--gpu", "gpu": "--gpu", "tp": "--tp", "quantization": "--quantization",
         "kv_cache_dtype": "--kv-cache-dtype", "enable_expert_parallel": "--enable-expert-parallel",
         "expert_load_imbalance": "--expert-load-imbalance",
         "gpu_memory_utilization": "--gpu-memory-utilization", "block_size": "--block-size"}


def _named_by_flags(run):
    """``run`` with the catalogue's and memory model's errors re-raised under the flag the value came from."""
    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except NoExperts as error:   # the switch is a flag given, not a value: say what is wrong with it
            raise UserError(f"--enable-expert-parallel: {error.dense}; leave the flag off") from None
        except InvalidValue as error:
            raise InvalidValue(FLAGS.get(error.name, error.name), error.value, error.expected) from None
    return wrapped


def _non_negative(name: str, value: int) -> None:
    if value < 0:
        raise UserError(f"{name} must be 0 or more, found {value}")


@_named_by_flags
def run_cost(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from servetune.cost_models.profile import find_profile, load_profile
    from servetune.cost_models.roofline import (HOST_PHASES, Calibration, build_roofline_params, experts_touched,
                                                step_costs)
    from servetune.types import StepBatch

    for name in ("decode_batch", "context", "prefill_tokens"):
        _non_negative("--" + name.replace("_", "-"), getattr(args, name))
    if args.decode_batch == 0 and args.prefill_tokens == 0:
        raise UserError("an empty step: give --decode-batch and/or --prefill-tokens")
    capture = _default_capture_size() if args.max_cudagraph_capture_size is None else args.max_cudagraph_capture_size
    _non_negative("--max-cudagraph-capture-size", capture)
    model = resolve_model(args.model, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    gpu = _resolve_gpu_flag(args.gpu)
    if args.expert_load_imbalance and not args.enable_expert_parallel:
        raise UserError("--expert-load-imbalance is for --enable-expert-parallel: under tensor parallelism every GPU "
                        "holds a slice of every expert, so routing cannot overload one")
    calibration = load_profile(find_profile(args.profile))[0] if args.profile else Calibration()
    params = build_roofline_params(model, gpu, args.tp, calibration, async_scheduling=args.scheduling == "async",
                                   cudagraph_capture_size=capture, expert_parallel=args.enable_expert_parallel,
                                   expert_load_imbalance=args.expert_load_imbalance)
    prefill = args.prefill_tokens
    batch = StepBatch(*(jnp.float32(x) for x in (
        1 if prefill else 0, prefill, prefill, prefill * prefill / 2, prefill * prefill / 2,
        args.decode_batch, args.decode_batch * (args.context + 1))))
    costs = {name: float(value) for name, value in vars(step_costs(params, batch)).items()}
    ms = {"matmul": costs["matmul_s"], "attention_prefill": costs["attention_prefill_s"],
          "attention_decode": costs["attention_decode_s"], "elementwise": costs["elementwise_s"],
          "communication": costs["communication_s"], "kernel_overheads": costs["overhead_s"],
          **{f"host_{phase}": costs[f"host_{phase}_s"] for phase in HOST_PHASES},
          "host_hidden_by_async": -costs["host_hidden_s"]}
    bound = "compute" if costs["compute_bound_s"] > costs["memory_bound_s"] else "memory"
    tokens = prefill + args.decode_batch
    result = {
        "model": model.name, "gpu": gpu.name, "tp": args.tp,
        "cost_model": "calibrated" if args.profile else "roofline",
        "batch": {"decode_batch": args.decode_batch, "context": args.context, "prefill_tokens": prefill},
        "scheduling": args.scheduling,
        "cuda_graph": {"max_capture_size": capture, "graphed": tokens <= capture,
                       "eager_launch_ms": 1e3 * costs["eager_launch_s"]},
        "step_time_ms": 1e3 * costs["total_s"],
        "breakdown_ms": {name: 1e3 * value for name, value in ms.items()},
        "gpu_ms": 1e3 * costs["gpu_s"], "host_ms": 1e3 * costs["host_s"],
        "host_hidden_ms": 1e3 * costs["host_hidden_s"],
        "step_time_sync_ms": 1e3 * (costs["gpu_s"] + costs["host_s"]),
        "step_time_async_ms": 1e3 * max(costs["gpu_s"], costs["host_s"]),
        "work": {"weight_bytes": costs["weight_bytes"], "kv_bytes_read": costs["kv_bytes"],
                 "activation_bytes": costs["activation_bytes"], "matmul_flops": costs["matmul_flops"],
                 "attention_flops": costs["attention_flops"], "allreduce_bytes": costs["allreduce_bytes"]},
        "bound": bound, "compute_bound_ms": 1e3 * costs["compute_bound_s"],
        "memory_bound_ms": 1e3 * costs["memory_bound_s"],
        "precision": _precision(model),
    }
    if model.moe is not None:
        # under uniform routing: the expected distinct experts the step's tokens go to (roofline.experts_touched)
        touched = model.moe.num_experts * experts_touched(1 - model.moe.experts_per_token / model.moe.num_experts,
                                                          tokens)
        result["moe"] = {"experts": model.moe.num_experts, "experts_per_token": model.moe.experts_per_token,
                         "moe_layers": model.moe.num_moe_layers, "experts_touched_per_layer": touched,
                         "routed_weight_bytes": costs["routed_weight_bytes"],
                         "expert_parallel": args.enable_expert_parallel,
                         "total_params": model.total_params, "active_params": model.active_params}
    if args.json:
        print(json.dumps(result))
        return 0
    work = result["work"]
    table = Table(title=f"{model.name} on {gpu.name} × {args.tp}: one step of {args.decode_batch} decodes "
                        f"(context {args.context}) + {prefill} prefill tokens, {args.scheduling} scheduling"
                        f"{_precision_note(model)}")
    table.add_column("part")
    table.add_column("ms", justify="right")
    table.add_column("detail", justify="right")
    graph = (f"CUDA graph (≤ {capture} tokens)" if tokens <= capture
             else f"eager (> {capture} tokens): {1e3 * costs['eager_launch_s']:.3f} launching")
    seqs = args.decode_batch + (1 if prefill else 0)
    rows = [("matmuls", ms["matmul"], f"{work['matmul_flops'] / 1e9:,.1f} GFLOP, "
                                      f"{work['weight_bytes'] / 1e9:,.2f} GB weights read"),
            *([("  of which routed experts", None,
                 f"{result['moe']['experts_touched_per_layer']:,.1f}/{model.moe.num_experts} experts a layer, "
                 f"{costs['routed_weight_bytes'] / 1e9:,.2f} GB")] if model.moe is not None else []),
            ("attention: prefill", ms["attention_prefill"], ""),
            ("attention: decode", ms["attention_decode"], f"{work['kv_bytes_read'] / 1e9:,.3f} GB KV read, "
                                                          f"{work['attention_flops'] / 1e9:,.1f} GFLOP"),
            ("element-wise", ms["elementwise"], f"{work['activation_bytes'] / 1e9:,.3f} GB activations"),
            ("communication", ms["communication"], f"{work['allreduce_bytes'] / 1e9:,.3f} GB all-reduced"),
            ("kernel overheads", ms["kernel_overheads"], graph)]
    for name, seconds, detail in rows:
        table.add_row(name, "" if seconds is None else f"{1e3 * seconds:.3f}", detail)
    table.add_row("GPU", f"{result['gpu_ms']:.3f}", f"{bound}-bound", style="bold")
    host_rows = [("host: schedule", "schedule", f"{seqs} requests"),
                 ("host: prepare inputs", "prepare_inputs", f"{seqs} requests" + (", to TP" if args.tp > 1 else "")),
                 ("host: sampler", "sampler", f"{seqs} sampled tokens"),
                 ("host: process outputs", "process_outputs", f"{seqs} sampled tokens")]
    for name, phase, detail in host_rows:
        table.add_row(name, f"{1e3 * ms['host_' + phase]:.3f}", detail)
    table.add_row("host", f"{result['host_ms']:.3f}", "", style="bold")
    table.add_row("host hidden (async)", f"{-result['host_hidden_ms']:.3f}",
                  "overlaps the GPU step" if args.scheduling == "async" else "sync: none")
    table.add_row("step", f"{result['step_time_ms']:.3f}",
                  f"sync {result['step_time_sync_ms']:.3f}, async {result['step_time_async_ms']:.3f}", style="bold")
    console = Console()
    console.print(table)
    console.print(f"compute side {result['compute_bound_ms']:.2f} ms vs memory side "
                  f"{result['memory_bound_ms']:.2f} ms: the step is {bound}-bound")
    return 0


def _precision(model) -> dict:
    """The weights' format and the KV cache's dtype ``model`` is served with, as the commands report them."""
    return {"weights": "bf16" if model.quantization is None else model.quantization.describe,
            "kv_cache_dtype": model.kv_cache_dtype}


def _precision_note(model) -> str:
    """The precision for a table's title; nothing for BF16 weights and cache, the default."""
    if model.quantization is None and model.kv_cache_dtype == "auto":
        return ""
    return f", weights {_precision(model)['weights']}, KV {model.kv_cache_dtype}"


@_named_by_flags
def run_memory(args: argparse.Namespace) -> int:
    model = resolve_model(args.model, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    gpu = _resolve_gpu_flag(args.gpu)
    capacity = kv_capacity(model, gpu, args.tp, args.gpu_memory_utilization, args.block_size,
                           args.max_num_batched_tokens, args.max_num_seqs,
                           expert_parallel=args.enable_expert_parallel)
    result = {"model": model.name, "gpu": gpu.name, "tp": args.tp, "precision": _precision(model),
              "expert_parallel": args.enable_expert_parallel,
              "gpu_memory_utilization": args.gpu_memory_utilization, "gpu_memory_bytes": gpu.memory_bytes,
              "weight_bytes_per_gpu": capacity.weight_bytes, "kv_bytes_per_token": capacity.kv_bytes_per_token,
              "activation_reserve_bytes": capacity.activation_reserve_bytes,
              "kv_cache_bytes": capacity.kv_cache_bytes, "block_size": capacity.block_size,
              "num_kv_blocks": capacity.num_kv_blocks, "token_capacity": capacity.token_capacity}
    if args.json:
        print(json.dumps(result))
        return 0
    experts = " with expert parallelism" if args.enable_expert_parallel else ""
    table = Table(title=f"KV cache of {model.name} on {gpu.name} × {args.tp}{experts} "
                        f"at gpu_memory_utilization {args.gpu_memory_utilization}{_precision_note(model)}")
    table.add_column("per GPU")
    table.add_column("value", justify="right")
    table.add_row("memory × utilization", f"{capacity.usable_bytes / GIB:.2f} GiB")
    table.add_row("weights", f"{capacity.weight_bytes / GIB:.2f} GiB")
    table.add_row("activation reserve", f"{capacity.activation_reserve_bytes / GIB:.2f} GiB")
    table.add_row("KV cache", f"{capacity.kv_cache_bytes / GIB:.2f} GiB")
    table.add_row("KV bytes per token", f"{capacity.kv_bytes_per_token:,} B")
    table.add_row("KV blocks", f"{capacity.num_kv_blocks:,} × {capacity.block_size} tokens", style="bold")
    table.add_row("token capacity", f"{capacity.token_capacity:,}", style="bold")
    Console().print(table)
    return 0


def _initial_calibration(args: argparse.Namespace, gpu, default_to_shipped: bool):
    """The calibration a fit starts from, and where it came from (a profile path, or the datasheet defaults)."""
    from servetune.cost_models.profile import find_profile, load_profile, shipped_profile_for
    from servetune.cost_models.roofline import Calibration

    if args.initial is not None:
        path = find_profile(args.initial)
        return load_profile(path)[0], args.initial
    shipped = shipped_profile_for(gpu.name) if default_to_shipped else None
    if shipped is not None:
        return load_profile(shipped)[0], f"shipped {shipped.name}"
    return Calibration(), "datasheet defaults"


@_named_by_flags
def run_calibrate(args: argparse.Namespace) -> int:
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.cost_models.calibrate import calibrate
    from servetune.cost_models.profile import write_profile

    if args.folds < 2:
        raise UserError(f"--folds must be at least 2, found {args.folds}")
    if args.bench is not None or args.config is not None or args.trials is not None:
        return _run_calibrate_bench(args)
    use_persistent_compilation_cache()   # the fits are jitted once per shape of their data
    if args.steps is not None:
        return _run_calibrate_steps(args)
    for flag in ("model", "fit"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag} is for --steps; the operator profiles name their own models")
    if args.force or args.gpu_time_only or args.async_scheduling:
        raise UserError("--force, --gpu-time-only and --async-scheduling are for --steps")
    check_output_file(args.out, "--out")
    gpu = _resolve_gpu_flag(args.gpu)
    initial, initial_source = _initial_calibration(args, gpu, default_to_shipped=False)
    console = Console(stderr=True)
    result = calibrate(args.profiles, args.attention, args.allreduce, args.cpu_overheads, args.distserve, gpu,
                       folds=args.folds, seed=args.seed, step_tp=args.step_tp, progress=console.print,
                       initial=initial)
    sources = {"profiles": [str(p) for p in args.profiles], "attention": _optional(args.attention),
               "allreduce": _optional(args.allreduce), "cpu_overheads": _optional(args.cpu_overheads),
               "distserve": _optional(args.distserve)}
    if args.initial is not None:
        kept = []
        if args.attention is None and args.distserve is None:
            kept.append("attention efficiencies and overhead (no attention measurement)")
        if args.cpu_overheads is None and args.distserve is None:
            kept.append("host overheads (no host measurement)")
        sources["initial"] = initial_source
        sources["kept_from_initial"] = kept
    write_profile(args.out, result.calibration, gpu.name, sources, result.report)
    if args.json:
        print(json.dumps({"profile": str(args.out), "calibration": result.calibration.as_floats(), **result.report}))
        return 0
    # One rule under the header, two spaces between columns and each data set's model on a line of its own:
    # an 80-column terminal shows every value whole.
    table = Table(title=f"held-out error ({args.folds}-fold by token count); profile written to {args.out}",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for column in ("data set", "rows", "MAPE\n%", "worst\n%", "uncalibrated\nMAPE %", "uncalibrated\nworst %"):
        table.add_column(column, justify="left" if column == "data set" else "right", no_wrap=True)
    for name, errors in result.report["datasets"].items():
        fitted, default = errors["calibrated"], errors["uncalibrated"]
        table.add_row(name.replace(":", ":\n", 1), f"{fitted['rows']:,}", f"{fitted['mape_pct']:.2f}",
                      f"{fitted['worst_pct']:+.1f}", f"{default['mape_pct']:.2f}", f"{default['worst_pct']:+.1f}")
    Console().print(table)
    return 0


def _run_calibrate_bench(args: argparse.Namespace) -> int:
    """``calibrate --bench --config``: checks that no other source's flag is given, then search/calibrate_bench.py."""
    if args.bench is None:
        raise UserError("--config and --trials are for --bench: give the `vllm bench serve` result to fit")
    if args.config is None:
        raise UserError("--bench needs --config: the deployment the benchmark ran (model, GPU, TP, scheduler)")
    given = [flag for flag, value in (("--steps", args.steps), ("--profiles", args.profiles),
                                      ("--attention", args.attention), ("--allreduce", args.allreduce),
                                      ("--cpu-overheads", args.cpu_overheads), ("--distserve", args.distserve),
                                      ("--model", args.model), ("--gpu-time-only", args.gpu_time_only),
                                      ("--async-scheduling", getattr(args, "async_scheduling", False))) if value]
    if given:
        raise UserError(f"--bench and {given[0]} are alternatives: --bench fits a benchmark replayed under "
                        f"--config, which names the model and GPU")
    from servetune.search.calibrate_bench import run_calibrate_bench

    return run_calibrate_bench(args)


def _optional(path):
    return None if path is None else str(path)


def _run_calibrate_steps(args: argparse.Namespace) -> int:
    """``calibrate --steps``: fit the parameters measured steps identify; refuse to write a fit that did not
    converge or predicts held-out steps worse than the uncalibrated roofline, unless ``--force``."""
    from servetune.cost_models.calibrate_steps import (
        FROM_ROWS, PREFERENCE, TOKEN_TILES, calibrate_steps, read_steps_csv,
    )
    from servetune.cost_models.roofline import MAX_TOKEN_TILE
    from servetune.cost_models.models import heads_per_gpu
    from servetune.cost_models.profile import write_profile

    for flag in ("profiles", "attention", "allreduce", "cpu_overheads", "distserve"):
        if getattr(args, flag):
            raise UserError(f"--{flag.replace('_', '-')} is for operator profiles, not for --steps")
    if args.model is None:
        raise UserError("--steps needs --model: the model the steps ran (a catalogue name or a config.json)")
    if args.tp < 1:
        raise InvalidValue("--tp", args.tp, "a whole number of GPUs, 1 or more")
    names = None
    if args.fit is not None:
        names = [name.strip() for name in args.fit.split(",") if name.strip()]
        unknown = [name for name in names if name not in PREFERENCE]
        if unknown or not names:
            raise InvalidValue("--fit", args.fit, f"comma-separated names from {', '.join(PREFERENCE)}")
        names = list(dict.fromkeys(names))
    token_tiles = TOKEN_TILES
    if args.token_tile is not None:
        if not 1 <= args.token_tile <= MAX_TOKEN_TILE:
            raise InvalidValue("--token-tile", args.token_tile, f"a whole number of tokens from 1 to {MAX_TOKEN_TILE}")
        token_tiles = (args.token_tile,)
    check_output_file(args.out, "--out")
    model, gpu = resolve_model(args.model), _resolve_gpu_flag(args.gpu)
    heads_per_gpu(model, args.tp)   # a TP degree that does not divide the heads is refused here, named --tp
    initial, initial_source = _initial_calibration(args, gpu, default_to_shipped=True)
    rows = read_steps_csv(args.steps)
    console = Console(stderr=True)
    console.print(f"{len(rows)} steps of {model.name} on {gpu.name} × {args.tp}; starting from {initial_source}")
    result = calibrate_steps(rows, model, gpu, args.tp, initial, names, folds=args.folds, seed=args.seed,
                             gpu_time_only=args.gpu_time_only, progress=console.print,
                             async_scheduling=args.async_scheduling, token_tiles=token_tiles,
                             split_kv_thresholds=FROM_ROWS if args.split_kv else None)
    kinds = result.report["batch_kinds"]
    held_out, uncalibrated = kinds["all"]["held_out"]["mape_pct"], kinds["all"]["uncalibrated"]["mape_pct"]
    problems = []
    if not result.converged:
        problems.append(f"the fit did not converge ({result.status.message})")
    if held_out > uncalibrated:
        problems.append(f"its held-out MAPE {held_out:.2f}% is worse than the uncalibrated roofline's "
                        f"{uncalibrated:.2f}%")
    write = not problems or args.force
    if write:
        sources = {"steps": str(args.steps), "model": model.name, "tp": args.tp, "rows": len(rows),
                   "gpu_time_only": args.gpu_time_only, "async_scheduling": args.async_scheduling,
                   "initial": initial_source, "fitted": result.fitted}
        write_profile(args.out, result.calibration, gpu.name, sources, result.report)
    if args.json:
        print(json.dumps({"profile": str(args.out) if write else None, "written": write, "problems": problems,
                          "calibration": result.calibration.as_floats(), **result.report}))
    else:
        _print_steps_report(args, result, initial_source, write)
    warning = unforced_fit_problems(args.steps, problems, write)
    if warning:
        console.print(warning)
    return 0


def _print_steps_report(args: argparse.Namespace, result, initial_source: str, written: bool) -> None:
    report = result.report
    where = f"profile written to {args.out}" if written else "no profile written"
    table = Table(title=f"step-time error by batch kind ({report['folds']}-fold held out by step shape); {where}",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for column in ("batch kind", "rows", "fit\nMAPE %", "held-out\nMAPE %", "held-out\nworst %",
                   "uncalibrated\nMAPE %", "start\nMAPE %"):
        table.add_column(column, justify="left" if column == "batch kind" else "right", no_wrap=True)
    for kind, errors in report["batch_kinds"].items():
        table.add_row(kind, f"{errors['fit']['rows']:,}", f"{errors['fit']['mape_pct']:.2f}",
                      f"{errors['held_out']['mape_pct']:.2f}", f"{errors['held_out']['worst_pct']:+.1f}",
                      f"{errors['uncalibrated']['mape_pct']:.2f}", f"{errors['initial']['mape_pct']:.2f}",
                      style="bold" if kind == "all" else None)
    console = Console()
    console.print(table)
    values = result.calibration.as_floats()
    console.print("fitted: " + ", ".join(f"{name} {values[name]:.4g}" for name in result.fitted))
    by_tile = report["token_tile_fit_mape_pct"]
    if len(by_tile) > 1:
        console.print(f"matmul token tile {report['matmul_token_tile']} (fit MAPE % by tile: "
                      + ", ".join(f"{tile} {mape:.2f}" for tile, mape in by_tile.items()) + ")")
    by_threshold = report.get("split_kv_fit_mape_pct", {})
    if report.get("split_kv_max_work", 0.0) > 0 or len(by_threshold) > 1:
        console.print(f"split-KV decode below {report['split_kv_max_work']:g} decode requests x query heads per GPU "
                      "(fit MAPE % by threshold, 0 = off: "
                      + ", ".join(f"{threshold} {mape:.2f}" for threshold, mape in by_threshold.items()) + ")")
    reasons: dict[str, list[str]] = {}
    for name, why in result.left_out.items():
        reasons.setdefault(why, []).append(name)
    console.print(f"kept from {initial_source} (the start column): "
                  + "; ".join(f"{', '.join(names)} ({why})" for why, names in reasons.items()))
    console.print("uncalibrated: the roofline's datasheet defaults")


def run_models(args: argparse.Namespace) -> int:
    from servetune.cost_models.memory import kv_bytes_per_token

    def experts(m) -> str:   # routed experts / experts per token (+ shared)
        if m.moe is None:
            return "-"
        shared = f"+{m.moe.shared_intermediate_size // m.moe.expert_intermediate_size}" \
            if m.moe.shared_intermediate_size else ""
        return f"{m.moe.num_experts}/{m.moe.experts_per_token}{shared}"

    rows = [{"name": m.name, "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
             "kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "intermediate": m.intermediate_size,
             "vocab": m.vocab_size, "gated_mlp": m.gated_mlp, "params_b": round(m.total_params / 1e9, 2),
             "active_params_b": round(m.active_params / 1e9, 2), "max_model_len": m.max_model_len,
             "heads_q_kv": f"{m.num_heads}/{m.num_kv_heads}", "experts": experts(m),
             "moe": None if m.moe is None else dataclasses.asdict(m.moe),
             "mla": None if m.mla is None else dataclasses.asdict(m.mla),
             "local_attention": None if m.local_attention is None else dataclasses.asdict(m.local_attention),
             "weights": "bf16" if m.quantization is None else m.quantization.method,
             "quantization": None if m.quantization is None else dataclasses.asdict(m.quantization),
             "kv_kib_per_token": round(kv_bytes_per_token(m, 1) / 1024, 2), "source": m.source}
            for m in MODELS.values()]
    return _print_catalogue(args, rows, "models: routed experts/per token (+shared), KV cache per token at TP 1 "
                                        "(every layer; MLA's latent), weights as published; --model also takes a "
                                        "config.json path; every field, sources included, with --json",
                            ["name", "layers", "experts", ("params_b", "params\n(B)"),
                             ("active_params_b", "active\n(B)"), ("kv_kib_per_token", "KV KiB\n/token"),
                             ("max_model_len", "context"), "weights"], compact=True)


def measured_profiles() -> dict[str, str]:
    """GPU name -> file name of the shipped calibrated profile measured on it. Read as plain JSON, without the
    profile module (which needs JAX), so that ``servetune gpus`` starts fast."""
    import importlib.util

    # the package's folder, found without importing it (its profile module needs JAX)
    cost_models_dir = Path(importlib.util.find_spec("servetune.cost_models").submodule_search_locations[0])
    profiles: dict[str, str] = {}
    for path in sorted((cost_models_dir / "profiles").glob("*.json")):
        try:
            gpu = json.loads(path.read_text(encoding="utf-8")).get("gpu")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(gpu, str):
            profiles.setdefault(gpu, path.name)
    return profiles


def run_gpus(args: argparse.Namespace) -> int:
    measured = measured_profiles()
    aliases: dict[str, list[str]] = {}
    for alias, name in GPU_ALIASES.items():
        aliases.setdefault(name, []).append(alias)

    def in_units(value, unit):   # the datasheet's figure, without the float noise of scaling it
        return None if value is None else round(value / unit, 6)

    rows = [{"name": g.name, "description": g.description, "bf16_tflops": in_units(g.peak_flops_per_s, 1e12),
             "fp8_tflops": in_units(g.peak_fp8_flops_per_s, 1e12),
             "int8_tops": in_units(g.peak_int8_ops_per_s, 1e12),
             "memory_gb_per_s": in_units(g.memory_bytes_per_s, 1e9), "memory_gib": in_units(g.memory_bytes, GIB),
             "interconnect_gb_per_s": in_units(g.interconnect_bytes_per_s, 1e9), "interconnect": g.interconnect,
             "source": g.source, "aliases": aliases.get(g.name, []), "measured_profile": measured.get(g.name),
             "step_costs": "measured" if g.name in measured else "datasheet"} for g in GPUS.values()]
    return _print_catalogue(args, rows, "GPUs: dense tensor peaks (-: no such tensor cores), link per GPU both "
                                        "ways; step costs: measured = a shipped calibrated profile (--json names "
                                        "it), datasheet = the roofline on these peaks; sources in "
                                        "cost_models/gpus.py; a GPU of your own: docs/config.md",
                            ["name", ("bf16_tflops", "BF16\nTFLOPS"), ("fp8_tflops", "FP8\nTFLOPS"),
                             ("int8_tops", "INT8\nTOPS"), ("memory_gib", "memory\nGiB"),
                             ("memory_gb_per_s", "memory\nGB/s"), ("interconnect_gb_per_s", "link\nGB/s"),
                             ("step_costs", "step\ncosts")], compact=True)


def _print_catalogue(args: argparse.Namespace, rows: list[dict], title: str, columns: list,
                     compact: bool = False) -> int:
    """All fields as JSON, or a table of the ``columns`` that fit an 80-column terminal (a column is a key, or
    a (key, header) pair; headers break over lines so that no value is cut; ``compact``: one rule under the header
    and two spaces between columns, for tables too wide for boxes)."""
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False) if compact \
        else Table(title=title)
    headers = [column if isinstance(column, str) else column[1] for column in columns]
    columns = [column if isinstance(column, str) else column[0] for column in columns]
    for column, header in zip(columns, headers):
        table.add_column(header, justify="left" if isinstance(rows[0][column], str) else "right", no_wrap=True)
    for row in rows:
        table.add_row(*("-" if row[c] is None else f"{row[c]:g}" if isinstance(row[c], float) else str(row[c])
                        for c in columns))
    Console().print(table)
    return 0
