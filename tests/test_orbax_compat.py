"""areal_jax/orbax_compat.py: the upstream leaks it works around still exist, and the workaround is scoped.

The first two tests reproduce tensorstore's leaks with the workaround off. They are meant to FAIL the day
tensorstore (or orbax, by no longer calling these functions per array) fixes them: the message then says
what to delete.
"""
from __future__ import annotations

import gc
import os
import sys
import threading

import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils

from areal_jax import orbax_compat
from areal_jax.checkpoint import Checkpointer

CALLS = 2000


def blocks_per_call(fn) -> float:
    """Python memory blocks left allocated per call of fn (after a warm-up and a full collection)."""
    for _ in range(50):
        fn()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(CALLS):
        fn()
    gc.collect()
    return (sys.getallocatedblocks() - before) / CALLS


def test_upstream_still_leaks_in_kvstore_spec_to_json(tmp_path):
    spec = {"driver": "file", "path": str(tmp_path) + "/"}
    assert blocks_per_call(lambda: dict(spec)) < 1  # the measure itself leaks nothing
    leaked = blocks_per_call(lambda: ts.KvStore.Spec(spec).to_json())
    assert leaked > 2, (
        f"tensorstore {ts.__version__} no longer leaks in KvStore.Spec(json).to_json() ({leaked:.2f} blocks per "
        "call, 4 in 0.1.86): remove _KvStoreWithResolvedSpecs / _TensorStoreModule from areal_jax/orbax_compat.py.")


def test_upstream_still_leaks_in_collect_matching_metrics(tmp_path):
    kv = ts.KvStore.open({"driver": "file", "path": str(tmp_path) + "/"}).result()
    kv.write("a", b"some bytes").result()  # so the file driver's byte counters exist
    assert kv.read("a").result().value == b"some bytes"
    leaked = blocks_per_call(lambda: ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"))
    assert leaked > 2, (
        f"tensorstore {ts.__version__} no longer leaks in experimental_collect_matching_metrics ({leaked:.2f} "
        "blocks per call): remove the get_tensorstore_raw_bytes patch from areal_jax/orbax_compat.py (and the "
        "module, once the KvStore.Spec leak is gone too).")


def test_orbax_still_has_the_patched_names():
    # orbax_compat silently does nothing when these move; this says so instead.
    assert orbax_compat._target_module() is tensorstore_utils, (
        "orbax's tensorstore_utils no longer has `ts` and `get_tensorstore_raw_bytes`: the workaround in "
        f"areal_jax/orbax_compat.py (written for orbax-checkpoint {orbax_compat.ORBAX_TARGET}) no longer applies; "
        "re-check the leaks (tests/test_reliability_recovery.py) and update or remove it.")


def test_the_workaround_is_scoped_nested_and_undone():
    real_ts, real_raw = tensorstore_utils.ts, tensorstore_utils.get_tensorstore_raw_bytes
    assert real_ts is ts and not orbax_compat.active()
    inside, release = threading.Event(), threading.Event()

    def other_thread():
        with orbax_compat.tensorstore_leak_workarounds():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other_thread)
    with orbax_compat.tensorstore_leak_workarounds():
        assert orbax_compat.active() and tensorstore_utils.ts is not real_ts
        assert tensorstore_utils.get_tensorstore_raw_bytes() is None
        t.start()
        assert inside.wait(10)
        with orbax_compat.tensorstore_leak_workarounds():
            assert tensorstore_utils.ts is not real_ts
    assert orbax_compat.active(), "another thread is still inside its scope"
    release.set()
    t.join(10)
    assert not orbax_compat.active()
    assert tensorstore_utils.ts is real_ts and tensorstore_utils.get_tensorstore_raw_bytes is real_raw


def test_patched_specs_resolve_like_tensorstore_without_leaking(tmp_path):
    spec = {"driver": "file", "path": str(tmp_path) + "/"}
    with orbax_compat.tensorstore_leak_workarounds():
        patched = tensorstore_utils.ts
        assert patched.KvStore.Spec(spec).to_json() == ts.KvStore.Spec(spec).to_json()
        assert patched.KvStore.Spec(spec).to_json(include_defaults=True) == ts.KvStore.Spec(spec).to_json(
            include_defaults=True)
        assert blocks_per_call(lambda: patched.KvStore.Spec(spec).to_json()) < 1
        kv = patched.KvStore.open(patched.KvStore.Spec(spec)).result()  # the real Spec reaches tensorstore
        kv.write("k", b"v").result()
    assert os.path.exists(tmp_path / "k")


def test_checkpoints_save_and_restore_with_the_patch_only_inside(tmp_path, monkeypatch):
    seen = []
    real_raw = tensorstore_utils.get_tensorstore_raw_bytes
    ckpt = Checkpointer(str(tmp_path), keep=1)
    assert not orbax_compat.active()  # building a Checkpointer patches nothing
    real_save = ckpt._mngr.save

    def save(*args, **kw):
        seen.append((orbax_compat.active(), tensorstore_utils.get_tensorstore_raw_bytes()))
        return real_save(*args, **kw)

    monkeypatch.setattr(ckpt._mngr, "save", save)
    state = {"w": jnp.arange(6.0).reshape(2, 3), "b": [jnp.ones(4), jnp.zeros(2)]}
    ckpt.save(1, state, {"version": 1})
    assert seen == [(True, None)] and not orbax_compat.active()
    assert tensorstore_utils.get_tensorstore_raw_bytes is real_raw
    restored, meta = ckpt.restore(1, state)
    ckpt.close()
    assert meta == {"version": 1} and not orbax_compat.active()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(restored["b"][0]), np.ones(4))

