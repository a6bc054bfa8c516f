"""Property test of the standby placement (``slots.place_standby`` with ``standby.write_moved_rows``) against a
plain numpy statement of its rule: waiting row number i (in row order) moves into the i-th free slot (in slot
order) while free slots last; a moved slot gets the row's cache positions [0, standby_len), logits, lengths,
last token and settings, a fresh budget and done=False; nothing else in the state changes."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_jax.models import KVCache
from areal_jax.sampler.slots import empty_decode_state, place_standby
from areal_jax.sampler.standby import write_moved_rows

S, R, T, TS, V, L = 6, 4, 10, 4, 5, 2  # slots, standby rows, cache length, standby length, vocab, layers


def random_state(rng, slots, length, done):
    cache = KVCache(k=tuple(rng.normal(size=(slots, length, 2, 3)).astype(np.float32) for _ in range(L)),
                    v=tuple(rng.normal(size=(slots, length, 2, 3)).astype(np.float32) for _ in range(L)))
    state = empty_decode_state(cache, V, slots, 2)
    return dataclasses.replace(
        state, logits=rng.normal(size=(slots, V)).astype(np.float32),
        lengths=rng.integers(1, length, slots).astype(np.int32), last_tokens=rng.integers(0, V, slots).astype(np.int32),
        done=np.asarray(done, bool), generated=rng.integers(0, 5, slots).astype(np.int32),
        max_new=rng.integers(1, 9, slots).astype(np.int32), temperature=rng.random(slots).astype(np.float32),
        top_k=rng.integers(0, 4, slots).astype(np.int32), top_p=rng.random(slots).astype(np.float32),
        stop_ids=rng.integers(-1, V, (slots, 2)).astype(np.int32))


_place = jax.jit(lambda state: place_standby(state, write_moved_rows))


@settings(max_examples=40, deadline=None)
@given(done=st.lists(st.booleans(), min_size=S, max_size=S), empty=st.lists(st.booleans(), min_size=R, max_size=R),
       seed=st.integers(0, 2**31 - 1))
def test_placement_follows_the_rule(done, empty, seed):
    rng = np.random.default_rng(seed)
    state = dataclasses.replace(random_state(rng, S, T, done), standby=random_state(rng, R, TS, empty))
    before = jax.tree.map(np.asarray, state)
    after, target = jax.tree.map(np.asarray, _place(jax.tree.map(np.asarray, state)))
    free, waiting = [s for s in range(S) if done[s]], [j for j in range(R) if not empty[j]]
    want = np.full(R, S)
    for i, j in enumerate(waiting[:len(free)]):
        want[j] = free[i]
    np.testing.assert_array_equal(target, want)
    sb = before.standby
    fields = ("logits", "lengths", "last_tokens", "max_new", "temperature", "top_k", "top_p", "stop_ids")
    for s in range(S):
        rows = [j for j in range(R) if want[j] == s]
        if rows:  # moved here: the row's cache prefix and fields, a fresh start
            j = rows[0]
            for layer in range(L):
                for name in ("k", "v"):
                    got, src = getattr(after.cache, name)[layer][s], getattr(sb.cache, name)[layer][j]
                    np.testing.assert_array_equal(got[:TS], src)
                    np.testing.assert_array_equal(got[TS:], getattr(before.cache, name)[layer][s][TS:])
            for f in fields:
                np.testing.assert_array_equal(getattr(after, f)[s], getattr(sb, f)[j], err_msg=f)
            assert not after.done[s] and after.generated[s] == 0
        else:  # untouched
            for f in fields + ("done", "generated"):
                np.testing.assert_array_equal(getattr(after, f)[s], getattr(before, f)[s], err_msg=f)
            for layer in range(L):
                np.testing.assert_array_equal(after.cache.k[layer][s], before.cache.k[layer][s])
    np.testing.assert_array_equal(after.standby.done, sb.done | (want < S))
