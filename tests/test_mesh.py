"""Device split and mesh layout (4 CPU devices from conftest; fake devices for several processes)."""
import dataclasses
import re

import jax
import pytest

from areal_jax.runtime.mesh import MeshConfig, build_meshes


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"


def ids(mesh):
    return mesh.device_ids.tolist()


def test_counts_split_local_devices():
    setup = build_meshes(MeshConfig(train_devices=3, rollout_devices=1, fsdp=-1, tensor=1))
    assert not setup.colocated
    assert setup.train_mesh.axis_names == ("fsdp", "tensor")
    assert ids(setup.train_mesh) == [[0], [1], [2]]
    assert ids(setup.rollout_mesh) == [[3]]
    assert set(setup.train_mesh.devices.flat).isdisjoint(setup.rollout_mesh.devices.flat)


def test_fraction_and_default_split():
    setup = build_meshes(MeshConfig(train_fraction=0.5, fsdp=1, tensor=-1))
    assert ids(setup.train_mesh) == [[0, 1]]
    assert dict(setup.rollout_mesh.shape) == {"replica": 1, "tensor": 2}
    assert ids(setup.rollout_mesh) == [[2, 3]]
    setup = build_meshes(MeshConfig(train_fraction=0.99))  # clamped: rollout keeps one device
    assert setup.train_mesh.devices.size == 3 and setup.rollout_mesh.devices.size == 1
    setup = build_meshes(MeshConfig())  # no split given: half each
    assert setup.train_mesh.devices.size == 2 and setup.rollout_mesh.devices.size == 2


def test_train_mesh_fsdp_tensor_and_rollout_tensor():
    setup = build_meshes(MeshConfig(rollout_devices=2, tensor=2, rollout_tensor=1))
    assert dict(setup.train_mesh.shape) == {"fsdp": 1, "tensor": 2}
    assert dict(setup.rollout_mesh.shape) == {"replica": 2, "tensor": 1}


def test_colocated_shares_devices():
    setup = build_meshes(MeshConfig(colocated=True, fsdp=2, tensor=2))
    assert setup.colocated
    assert ids(setup.train_mesh) == [[0, 1], [2, 3]]
    assert sorted(setup.rollout_mesh.device_ids.flat) == [0, 1, 2, 3]
    one = build_meshes(MeshConfig(), devices=jax.devices()[:1])
    assert one.colocated
    assert one.train_mesh.devices.flat[0] == one.rollout_mesh.devices.flat[0]


@pytest.mark.parametrize(
    "cfg, message",
    [
        (MeshConfig(train_devices=3, rollout_devices=2), "train_devices=3 + rollout_devices=2 exceeds the 4 local devices"),
        (MeshConfig(train_devices=4, rollout_devices=1, fsdp=3, tensor=2), "exceeds the 4 local devices"),
        (MeshConfig(train_devices=4), "leaves no rollout device"),
        (MeshConfig(rollout_devices=4), "leaves no training device"),
        (MeshConfig(colocated=True, fsdp=3, tensor=2), "fsdp*tensor=6 does not equal the 4 train devices"),
        (MeshConfig(train_devices=3, rollout_devices=1, tensor=2), "tensor=2 does not divide the 3 train devices"),
        (MeshConfig(train_fraction=1.5), "between 0 and 1"),
        (MeshConfig(train_devices=2, train_fraction=0.5), "not both"),
        (MeshConfig(rollout_devices=3, rollout_tensor=2), "rollout_tensor=2 does not divide the 3 rollout"),
        (MeshConfig(colocated=True, train_devices=2), "colocated"),
    ],
)
def test_split_errors_are_sentences(cfg, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_meshes(cfg)


def test_multi_process_train_mesh_is_global_rollout_is_local():
    # Two processes with 4 devices each; this process is process 0 (jax.process_index()).
    devices = [FakeDevice(id=i, process_index=i // 4) for i in range(8)]
    setup = build_meshes(MeshConfig(train_devices=2, rollout_devices=2, tensor=2), devices=devices)
    # Train slices of both processes, ordered by process; tensor groups stay within a host.
    assert ids(setup.train_mesh) == [[0, 1], [4, 5]]
    assert ids(setup.rollout_mesh) == [[2, 3]]
    with pytest.raises(ValueError, match="same number of local devices"):
        build_meshes(MeshConfig(), devices=devices[:7])
