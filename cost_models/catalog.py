"""Looking models and GPUs up by the names users type (``--model``, ``model:``, ``--gpu``, ``hardware.gpu``)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from servetune.cost_models.gpus import GPU_ALIASES, GPUS, GpuSpec
from servetune.cost_models.hf_config import load_hf_config
from servetune.cost_models.models import MODEL_ALIASES, MODELS, ModelSpec
from servetune.cost_models.naming import normalise_name, unknown_name_error
from servetune.errors import InvalidValue


def _looks_like_path(name: str) -> bool:
    if name.endswith(".json") or name.startswith((".", "/", "~")):
        return True
    try:
        return Path(name).expanduser().is_dir()
    except OSError:   # a name too long to be a path is no folder
        return False


def resolve_model(name_or_path: str, base_dir: Optional[Path] = None) -> ModelSpec:
    """A catalogue model by name (any case; Hugging Face repository names accepted), or the model a
    ``config.json`` describes (a file, or a folder holding one; relative paths start at ``base_dir``). An unknown
    name raises an ``InvalidValue``, a config.json that cannot be read a ``UserError`` naming it.
    """
    if "\0" in name_or_path:   # no file has a NUL in its name, and os refuses one with a ValueError
        raise InvalidValue("model", name_or_path, "a model name or the path of a config.json, without NUL characters")
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        return load_hf_config(path)
    key = normalise_name(name_or_path)
    key = MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise unknown_name_error("model", name_or_path, MODELS, " or the path of a Hugging Face config.json")
    return MODELS[key]


def resolve_gpu(name: str) -> GpuSpec:
    """The catalogue entry for ``name`` (any case; aliases accepted), or an InvalidValue listing the known GPUs."""
    key = normalise_name(name)
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise unknown_name_error("GPU", name, GPUS)
    return GPUS[key]


# The config field each name the cost models give a bad value comes from (resolve_model's model, kv_capacity's
# gpu, heads_per_gpu's tp, ...).
CONFIG_FIELDS = {"model": "model", "GPU": "hardware.gpu", "gpu": "hardware.gpu", "tp": "hardware.tp",
                 "gpu_memory_utilization": "hardware.gpu_memory_utilization", "block_size": "scheduler.block_size",
                 "profile": "cost_model.profile"}


@contextmanager
def as_config_fields() -> Iterator[None]:
    """Re-raise the ``InvalidValue``s raised inside under the config field the value came from."""
    try:
        yield
    except InvalidValue as error:
        raise InvalidValue(CONFIG_FIELDS.get(error.name, error.name), error.value, error.expected) from None
