"""Looking models and GPUs up by the names users type (``--model``, ``model:``, ``--gpu``, ``hardware.gpu``)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from servetune.config import GpuDefinition
from servetune.cost_models.gpus import GIB, GIGA, GPU_ALIASES, GPUS, TERA, GpuSpec
from servetune.cost_models.hf_config import load_hf_config
from servetune.cost_models.models import MODEL_ALIASES, MODELS, ModelSpec, with_serving_options
from servetune.cost_models.naming import normalise_name, unknown_name_error
from servetune.errors import InvalidValue


def _looks_like_path(name: str) -> bool:
    if name.endswith(".json") or name.startswith((".", "/", "~")):
        return True
    try:
        return Path(name).expanduser().is_dir()
    except OSError:   # a name too long to be a path is no folder
        return False


def resolve_model(name_or_path: str, base_dir: Optional[Path] = None, quantization: Optional[str] = None,
                  kv_cache_dtype: str = "auto") -> ModelSpec:
    """A catalogue model by name (any case; Hugging Face repository names accepted), or the model a
    ``config.json`` describes (a file, or a folder holding one; relative paths start at ``base_dir``), as vLLM
    serves it with ``--quantization quantization`` and ``--kv-cache-dtype kv_cache_dtype`` (the config's keys of
    those names; ``models.with_serving_options``). An unknown name, or a quantisation vLLM would refuse, raises an
    ``InvalidValue``, a config.json that cannot be read a ``UserError`` naming it.
    """
    if "\0" in name_or_path:   # no file has a NUL in its name, and os refuses one with a ValueError
        raise InvalidValue("model", name_or_path, "a model name or the path of a config.json, without NUL characters")
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        model = load_hf_config(path)
    else:
        key = normalise_name(name_or_path)
        key = MODEL_ALIASES.get(key, key)
        if key not in MODELS:
            raise unknown_name_error("model", name_or_path, MODELS, " or the path of a Hugging Face config.json")
        model = MODELS[key]
    if quantization is None and kv_cache_dtype == "auto":
        return model
    return with_serving_options(model, quantization, kv_cache_dtype)


def catalogue_gpu(name: str) -> Optional[GpuSpec]:
    """The catalogue entry ``name`` stands for (any case; aliases accepted), or None."""
    key = normalise_name(name)
    return GPUS.get(GPU_ALIASES.get(key, key))


def resolve_gpu(gpu: Union[str, GpuDefinition]) -> GpuSpec:
    """A catalogue GPU by name, or the GPU a user defined (``hardware.gpu`` as a mapping or a file, which the config
    loader has read into a ``GpuDefinition``); an unknown name raises an InvalidValue listing the known GPUs."""
    if isinstance(gpu, GpuDefinition):
        return _defined_gpu(gpu)
    spec = catalogue_gpu(gpu)
    if spec is None:
        raise unknown_name_error("GPU", gpu, GPUS, " or the path of a .yaml/.yml/.json file defining one "
                                                   "(docs/config.md)")
    return spec


def _defined_gpu(definition: GpuDefinition) -> GpuSpec:
    """A user's GPU in the catalogue's units: GiB, 10^9 B/s and 10^12 FLOP/s, as ``servetune gpus`` prints them."""
    def tera(value: Optional[float]) -> Optional[float]:
        return None if value is None else value * TERA

    return GpuSpec(name=definition.name, description=definition.description or definition.name,
                   peak_flops_per_s=definition.bf16_tflops * TERA,
                   memory_bytes_per_s=definition.memory_gb_per_s * GIGA, memory_bytes=definition.memory_gib * GIB,
                   interconnect_bytes_per_s=definition.interconnect_gb_per_s * GIGA,
                   interconnect="user-defined", source="user-defined",
                   peak_fp8_flops_per_s=tera(definition.fp8_tflops), peak_int8_ops_per_s=tera(definition.int8_tops))


# The config field each name the cost models give a bad value comes from (resolve_model's model, kv_capacity's
# gpu, heads_per_gpu's tp, ...).
CONFIG_FIELDS = {"model": "model", "GPU": "hardware.gpu", "gpu": "hardware.gpu", "tp": "hardware.tp",
                 "enable_expert_parallel": "hardware.enable_expert_parallel",
                 "gpu_memory_utilization": "hardware.gpu_memory_utilization", "block_size": "scheduler.block_size",
                 "profile": "cost_model.profile"}


@contextmanager
def as_config_fields() -> Iterator[None]:
    """Re-raise the ``InvalidValue``s raised inside under the config field the value came from."""
    try:
        yield
    except InvalidValue as error:
        raise InvalidValue(CONFIG_FIELDS.get(error.name, error.name), error.value, error.expected) from None
