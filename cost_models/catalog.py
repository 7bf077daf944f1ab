"""Looking models and GPUs up by the names users type (``--model``, ``model:``, ``--gpu``, ``hardware.gpu``)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from servetune.cost_models.gpus import GPU_ALIASES, GPUS, GpuSpec
from servetune.cost_models.hf_config import load_hf_config
from servetune.cost_models.models import MODEL_ALIASES, MODELS, ModelSpec
from servetune.cost_models.naming import normalise_name, unknown_name_error


def _looks_like_path(name: str) -> bool:
    return name.endswith(".json") or name.startswith((".", "/", "~")) or Path(name).expanduser().is_dir()


def resolve_model(name_or_path: str, base_dir: Optional[Path] = None) -> ModelSpec:
    """A catalogue model by name (any case; Hugging Face repository names accepted), or the model a
    ``config.json`` describes (a file, or a folder holding one; relative paths start at ``base_dir``).
    """
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        return load_hf_config(path)
    key = normalise_name(name_or_path)
    key = MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise unknown_name_error("model", name_or_path, MODELS)
    return MODELS[key]


def resolve_gpu(name: str) -> GpuSpec:
    """The catalogue entry for ``name`` (any case; aliases accepted), or a UserError listing the known GPUs."""
    key = normalise_name(name)
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise unknown_name_error("GPU", name, GPUS)
    return GPUS[key]
