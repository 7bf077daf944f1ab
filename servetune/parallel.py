"""Batches spread over the machine's cores.

XLA runs a CPU device's program on one thread at a time, so a vmapped batch of configs or envs uses one
core however many the machine has. Exposing each core as a CPU device and splitting the batch across
them (``shard_map``) runs the parts side by side; the rows are independent, so each row's result is the
same as in one batch.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CORES_AXIS = "cores"   # the mesh axis of the local devices, named in programs that exchange data between them


def use_all_cores() -> None:
    """Before JAX's backend starts, make each core available to this process a CPU device. Leaves a count
    the user chose (``JAX_NUM_CPU_DEVICES``, or XLA's host device count flag) alone, and does nothing once
    the backend has started (the batches then run on one device, as before)."""
    if "JAX_NUM_CPU_DEVICES" in os.environ or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", len(os.sched_getaffinity(0)))
    except RuntimeError:   # the backend is already up
        pass


@lru_cache(maxsize=None)
def cores_mesh() -> Mesh:
    """The local devices as one mesh axis, CORES_AXIS."""
    return Mesh(np.array(jax.local_devices()), (CORES_AXIS,))


def cores_dividing(size: int) -> int:
    """How many cores a batch of `size` rows that cannot be padded splits over: the device count where it
    divides `size`, else 1."""
    devices = len(jax.local_devices())
    return devices if size % devices == 0 else 1


def across_cores(batched_fn: Callable, batched: Sequence[bool]) -> Callable:
    """`batched_fn(*args)`, where the args flagged in `batched` carry a leading batch axis (the rest are
    shared), run with that axis split across the local devices. Every output must carry the batch axis. A
    batch the device count does not divide is padded with copies of its last row, cut off afterwards; one
    smaller than the device count, or one device, runs as `batched_fn` itself. Call it inside ``jit``."""
    batched = tuple(batched)

    def run(*args):
        devices = len(jax.local_devices())
        size = jax.tree_util.tree_leaves([a for a, b in zip(args, batched) if b])[0].shape[0]
        if devices == 1 or size < devices:
            return batched_fn(*args)
        padded = -size % devices

        def pad(x):
            return jnp.concatenate([x, jnp.repeat(x[-1:], padded, axis=0)]) if padded else x

        args = tuple(jax.tree_util.tree_map(pad, a) if b else a for a, b in zip(args, batched))
        specs = tuple(PartitionSpec(CORES_AXIS) if b else PartitionSpec() for b in batched)
        out = jax.shard_map(batched_fn, mesh=cores_mesh(), in_specs=specs, out_specs=PartitionSpec(CORES_AXIS),
                            check_vma=False)(*args)
        return jax.tree_util.tree_map(lambda x: x[:size], out) if padded else out

    return run


def laid_out(tree, size: int):
    """`tree`'s arrays (leading axis `size`) laid out across the devices as `across_cores` leaves a batch of
    that size, so that a jitted step fed its own outputs sees one input layout from the first call on (a new
    layout is a recompile): split when the device count divides the batch, else whole on every device (the
    padded rows are cut off after the split). A batch smaller than the device count is left as it is."""
    devices = len(jax.local_devices())
    if devices == 1 or size < devices:
        return tree
    spec = PartitionSpec() if size % devices else PartitionSpec(CORES_AXIS)
    return jax.device_put(tree, NamedSharding(cores_mesh(), spec))


def on_every_device(tree):
    """`tree` whole on every local device; inside ``jit``, the layout of its outputs. A jitted program whose state
    goes in and comes out this way, whatever `across_cores` splits inside it, sees one input layout from the first
    call on, so it compiles once (an RL update fed its own state, a state restored from a checkpoint)."""
    if len(jax.local_devices()) == 1:
        return tree
    return jax.device_put(tree, NamedSharding(cores_mesh(), PartitionSpec()))
