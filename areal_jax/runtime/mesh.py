"""Split a host's devices into a train slice and a rollout slice, and build their meshes.

Every host runs the same split. The train slices of all processes form ONE global mesh (axes
("fsdp", "tensor"), devices ordered by process index, then by local device id) on which the PPO update
runs as a single SPMD program. Each process's rollout slice gets its own local mesh (axes ("replica",
"tensor"); by default one replica with every rollout device on the tensor axis): each row of it runs its own
sampler engine on its own requests (data-parallel rollout, `sampler.replicas`), with a whole copy of the weights
split over that row's tensor devices.

With one local device (or `colocated=True`) both slices are the same devices: the train mesh and the
rollout mesh share them and `MeshSetup.colocated` is True.

The tensor axis is the fastest-varying axis of the train mesh, so as long as `tensor` divides the
per-host train device count a tensor-parallel group never spans two hosts.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from areal_jax.knobs import Section, knob, require

MESH_AXES: tuple[str, str] = ("fsdp", "tensor")
ROLLOUT_AXES: tuple[str, str] = ("replica", "tensor")  # no logical axis maps to "replica": weights replicate over it


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """How to split each host's local devices and lay out the meshes (the config's `mesh` section).

    Give at most one of (train_devices and/or rollout_devices) or train_fraction; with none of them
    a single device is shared (colocated) and several devices are split in half (train gets the
    smaller half when the count is odd, never zero). Whether the sizes fit the devices is checked by
    `build_meshes`, once the devices are known.
    """

    section: ClassVar[str] = "mesh"

    train_devices: int | None = knob(None, "local devices per host for training (None: the rest after "
                                     "rollout_devices, or from train_fraction)")
    rollout_devices: int | None = knob(None, "local devices per host for generation (None: the rest after "
                                       "train_devices)")
    train_fraction: float | None = knob(None, "share of the local devices for training, in (0, 1); rounded, at "
                                        "least one device for each slice")
    fsdp: int = knob(-1, "size of the global train mesh's fsdp axis; -1 fills (global train devices / tensor)")
    tensor: int = knob(1, "size of the train mesh's tensor axis")
    rollout_tensor: int = knob(-1, "size of each rollout mesh's tensor axis; -1 puts every rollout device on it "
                               "(one sampler), otherwise the rollout mesh is (rollout_devices / rollout_tensor "
                               "replicas, rollout_tensor): one sampler per replica, each with a whole copy of the "
                               "weights over its rollout_tensor devices and its own rollout.num_slots")
    colocated: bool = knob(False, "train and rollout share every local device (synchronous setups on one slice)")
    device_memory_gib: float | None = knob(None, "memory per device the run's plan must fit (system.memory; None: "
                                           "what the device reports, and a CPU reports none, so nothing is checked)")

    def check(self) -> None:
        require(self.device_memory_gib is None or self.device_memory_gib > 0,
                f"{self.key('device_memory_gib')}={self.device_memory_gib} must be positive (None: what the device "
                "reports).")


@dataclasses.dataclass(frozen=True)
class MeshSetup:
    """The meshes a run uses.

    Attributes:
      train_mesh: global mesh over every process's train slice, axes ("fsdp", "tensor").
      rollout_mesh: this process's rollout mesh, axes ("replica", "tensor").
      colocated: True when the two meshes use the same devices.
    """

    train_mesh: Mesh
    rollout_mesh: Mesh
    colocated: bool

    @property
    def replica_meshes(self) -> list[Mesh]:
        """One mesh per rollout replica (`replica_meshes`)."""
        return replica_meshes(self.rollout_mesh)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """The rows of a rollout mesh along its first axis, each a mesh of the same axis names (first axis of size 1):
    the devices of one sampler replica."""
    return [Mesh(mesh.devices[i:i + 1], mesh.axis_names, axis_types=mesh.axis_types)
            for i in range(mesh.devices.shape[0])]


def rollout_mesh(devices: Sequence[jax.Device], replicas: int, tensor: int) -> Mesh:
    """The rollout mesh (axes ROLLOUT_AXES) over the first replicas * tensor of `devices`, in their order: row i is
    replica i's devices."""
    devices = list(devices)
    if replicas < 1 or tensor < 1 or replicas * tensor > len(devices):
        raise ValueError(f"{replicas} rollout replicas x {tensor} tensor devices do not fit the {len(devices)} devices "
                         "given; lower one of them.")
    return Mesh(np.array(devices[:replicas * tensor], dtype=object).reshape(replicas, tensor), ROLLOUT_AXES)


def _split_counts(cfg: MeshConfig, n_local: int) -> tuple[int, int, bool]:
    """Return (n_train, n_rollout, colocated) per host from the config and the local device count."""
    counts_given = cfg.train_devices is not None or cfg.rollout_devices is not None
    if counts_given and cfg.train_fraction is not None:
        raise ValueError(
            "MeshConfig sets both device counts and train_fraction; give either train_devices/"
            "rollout_devices or train_fraction, not both."
        )
    for name in ("train_devices", "rollout_devices"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be at least 1 (or None to derive it).")
    if cfg.colocated or n_local == 1:
        for name in ("train_devices", "rollout_devices"):
            value = getattr(cfg, name)
            if value is not None and value != n_local:
                raise ValueError(
                    f"{name}={value} cannot be used in colocated mode, where train and rollout share "
                    f"all {n_local} local device(s); leave it None or set it to {n_local}."
                )
        return n_local, n_local, True

    if cfg.train_fraction is not None:
        f = cfg.train_fraction
        if not 0.0 < f < 1.0:
            raise ValueError(
                f"train_fraction={f} must lie strictly between 0 and 1 (share of the {n_local} "
                "local devices used for training)."
            )
        n_train = min(max(int(round(f * n_local)), 1), n_local - 1)
        return n_train, n_local - n_train, False

    n_train, n_rollout = cfg.train_devices, cfg.rollout_devices
    if n_train is None and n_rollout is None:
        n_train = n_local // 2
        n_rollout = n_local - n_train
    elif n_train is None:
        n_train = n_local - n_rollout
        if n_train < 1:
            raise ValueError(
                f"rollout_devices={n_rollout} leaves no training device out of the {n_local} local "
                "devices; lower rollout_devices or set colocated=True to share the devices."
            )
    elif n_rollout is None:
        n_rollout = n_local - n_train
        if n_rollout < 1:
            raise ValueError(
                f"train_devices={n_train} leaves no rollout device out of the {n_local} local "
                "devices; lower train_devices or set colocated=True to share the devices."
            )
    if n_train + n_rollout > n_local:
        raise ValueError(
            f"train_devices={n_train} + rollout_devices={n_rollout} exceeds the {n_local} local "
            "devices; lower one of them (or set colocated=True to share the devices)."
        )
    return n_train, n_rollout, False


def _axis_sizes(n_devices: int, first: int, second: int, names: tuple[str, str], what: str) -> tuple[int, int]:
    """Resolve a (first, second) mesh shape where first=-1 / second=-1 fills the device count."""
    if first == -1 and second == -1:
        raise ValueError(f"Only one of {names[0]} and {names[1]} may be -1 (fill) for the {what} mesh.")
    for name, value in zip(names, (first, second)):
        if value != -1 and value < 1:
            raise ValueError(f"{name}={value} must be a positive size or -1 (fill the {what} devices).")
    if first == -1:
        if n_devices % second:
            raise ValueError(
                f"{names[1]}={second} does not divide the {n_devices} {what} devices; choose a "
                f"{names[1]} that divides {n_devices}."
            )
        first = n_devices // second
    elif second == -1:
        if n_devices % first:
            raise ValueError(
                f"{names[0]}={first} does not divide the {n_devices} {what} devices; choose a "
                f"{names[0]} that divides {n_devices}."
            )
        second = n_devices // first
    if first * second != n_devices:
        raise ValueError(
            f"{names[0]}*{names[1]}={first * second} does not equal the {n_devices} {what} devices; "
            f"set {names[0]}=-1 to fill, or choose sizes whose product is {n_devices}."
        )
    return first, second


def _local_devices_of(process_index: int, all_devices: Sequence[jax.Device]) -> list[jax.Device]:
    return sorted((d for d in all_devices if d.process_index == process_index), key=lambda d: d.id)


def build_meshes(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> MeshSetup:
    """Split the local devices and build the global train mesh and the local rollout mesh.

    Args:
      cfg: the split and the mesh shapes.
      devices: all devices of the job (default `jax.devices()`); mainly for tests. Each process
        uses the devices whose `process_index` equals `jax.process_index()` as its local devices.
    Returns:
      MeshSetup(train_mesh, rollout_mesh, colocated).
    Raises:
      ValueError: with a sentence saying what to change when the sizes do not fit the devices.
    """
    all_devices = list(jax.devices() if devices is None else devices)
    process_ids = sorted({d.process_index for d in all_devices})
    me = jax.process_index()
    local = _local_devices_of(me, all_devices)
    if not local:
        raise ValueError(f"No devices of process {me} were given to build_meshes.")
    n_local = len(local)
    for p in process_ids:
        if len(_local_devices_of(p, all_devices)) != n_local:
            raise ValueError(
                "Every process must have the same number of local devices to split them the same "
                f"way; process {p} has {len(_local_devices_of(p, all_devices))}, process {me} has "
                f"{n_local}."
            )
    n_train, n_rollout, colocated = _split_counts(cfg, n_local)

    # The train slice is each process's first n_train devices, ordered by process.
    train_devices = [d for p in process_ids for d in _local_devices_of(p, all_devices)[:n_train]]
    n_train_global = len(train_devices)
    fsdp, tensor = _axis_sizes(n_train_global, cfg.fsdp, cfg.tensor, MESH_AXES, "train")
    train_mesh = Mesh(np.array(train_devices, dtype=object).reshape(fsdp, tensor), MESH_AXES)

    rollout_local = local[:n_rollout] if colocated else local[n_train:n_train + n_rollout]
    r_tensor = n_rollout if cfg.rollout_tensor == -1 else cfg.rollout_tensor
    replicas, r_tensor = _axis_sizes(n_rollout, -1, r_tensor, ("rollout replicas", "rollout_tensor"), "rollout")
    return MeshSetup(train_mesh=train_mesh, rollout_mesh=rollout_mesh(rollout_local, replicas, r_tensor),
                     colocated=colocated)
