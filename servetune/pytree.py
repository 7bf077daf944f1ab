"""Frozen dataclasses that JAX treats as pytrees (the gymnax / flax.struct style).

Fields are traced leaves unless declared with ``static_field()``; static fields become part of the
treedef, so changing one recompiles and vmapping over one is impossible -- exactly what we want for
capacity bounds such as the slot count.
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls: type[T]) -> type[T]:
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def replace(obj: T, **changes: Any) -> T:
    return dataclasses.replace(obj, **changes)
