"""benchmarks/loop.py at a toy size, and the synthetic-load pieces it is built from (system/loadgen.py)."""
import json
import os

import numpy as np
import pytest

from areal_jax.models.transformer import cache_dtype
from areal_jax.system import loadgen
from areal_jax.testing.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_benchmark():
    return load_script("benchmarks/loop.py")


def test_long_tail_lengths_have_the_asked_median_tail_and_cap():
    x = loadgen.long_tail_lengths(200_000, 100, 1000, sigma=1.0, seed=1)
    assert x.min() >= 1 and x.max() == 1000
    assert abs(np.median(x) - 100) <= 2
    # log-normal: the 90th percentile sits at median * exp(1.2816 * sigma)
    assert abs(np.quantile(x, 0.9) / (100 * np.exp(1.2816)) - 1) < 0.03
    assert np.mean(x == 1000) == pytest.approx(1 - 0.5 * (1 + __import__("math").erf(np.log(10) / np.sqrt(2))), abs=0.003)
    with pytest.raises(ValueError, match="median"):
        loadgen.long_tail_lengths(10, 50, 20)


def test_bernoulli_reward_is_a_fair_deterministic_coin():
    texts = [loadgen.ids_as_text(list(range(i, i + 5))) for i in range(4000)]
    r = np.array([loadgen.bernoulli_reward(t, "") for t in texts])
    assert set(np.unique(r)) == {0.0, 1.0}
    assert abs(r.mean() - 0.5) < 0.03  # 4000 draws: 4 standard errors is 0.032
    assert [loadgen.bernoulli_reward(t, "x") for t in texts[:50]] == list(r[:50])


@pytest.mark.parametrize("architecture", [pytest.param("qwen2", marks=pytest.mark.long),  # 28 s in CI
                                          "gemma3"])  # a plain final norm (long) and Gemma's offset form
def test_tempered_random_logits_have_the_asked_entropy(architecture):
    import jax
    import jax.numpy as jnp

    from areal_jax.testing import models as testing

    cfg = testing.tiny_config(architecture, vocab_size=512, tie_word_embeddings=True)
    model = testing.random_model(cfg, seed=3)

    def entropy(seed, shape=(4, 64)):  # over random tokens, by the full forward
        tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, shape), jnp.int32)
        logp = jax.nn.log_softmax(model(tokens), axis=-1)
        return float(jnp.mean(-jnp.sum(jnp.exp(logp) * logp, axis=-1)))

    def sampled_entropy(seed, rows=32, length=128, prompt=16):
        """Along the model's own samples at temperature 1, drawn by repeated full forwards (not the KV cache
        temper_logits samples with): the entropy of each distribution a token was drawn from."""
        rng = np.random.default_rng(seed)
        tokens = np.asarray(rng.integers(0, cfg.vocab_size, (rows, length)), np.int32)
        seen = []
        forward = jax.jit(lambda x: jax.nn.log_softmax(model(x).astype(jnp.float32), axis=-1))
        for t in range(prompt, length):  # causal: the logits at t - 1 read tokens up to t - 1 only
            logp = np.asarray(forward(jnp.asarray(tokens))[:, t - 1], np.float64)
            p = np.exp(logp)
            seen.append(-(p * logp).sum(-1))
            tokens[:, t] = [rng.choice(cfg.vocab_size, p=row / row.sum()) for row in p]
        return float(np.mean(seen))

    assert entropy(7) < 0.2  # untempered: a random model's samples at temperature 1 would repeat each other
    before = np.asarray(model.final_norm.scale[...])
    factor = testing.temper_logits(model, 1.5, seed=3)
    after = np.asarray(model.final_norm.scale[...])
    one = 1.0 if architecture == "gemma3" else 0.0
    np.testing.assert_allclose(after + one, (before + one) * factor, rtol=1e-6)  # the norm's factor, scaled
    # what a sampler of the model meets (one row's entropy ranges over 0.7-2.3 nats: many rows)
    assert sampled_entropy(11) == pytest.approx(1.5, abs=0.2)
    assert entropy(7) > 1.0  # random text is no longer near-certain either
    with pytest.raises(ValueError, match="log\\(vocab_size\\)"):
        testing.temper_logits(model, 7.0)  # log(512) = 6.24 nats is the most there is


def test_forced_lengths_rewrites_each_request():
    from areal_jax.sampler import Request

    class Recorder:
        current_version = 7

        def __init__(self):
            self.got = []

        def submit(self, request):
            self.got.append(request)

    rec = Recorder()
    wrapped = loadgen.ForcedLengths(rec, np.array([5, 9, 2]))
    for gid in range(4):
        wrapped.submit(Request(id=gid, prompt=[1, 2], max_new_tokens=100, n=3, stop_token_ids=(4,)))
    assert [r.max_new_tokens for r in rec.got] == [5, 9, 2, 5]
    assert all(r.stop_token_ids == () and r.n == 3 and r.prompt == [1, 2] for r in rec.got)
    assert wrapped.current_version == 7  # everything else is the wrapped loop's


def test_the_loop_plan_counts_the_published_qwen_size_and_names_what_to_shrink():
    import jax
    from flax import nnx

    from areal_jax.config import from_config_dict
    from areal_jax.knobs import ConfigError
    from areal_jax.runtime.mesh import MeshConfig, build_meshes
    from areal_jax.system.memory import GiB, JobMemory
    from areal_jax.testing.models import random_model

    meshes = build_meshes(MeshConfig(), devices=jax.devices()[:1])  # one device: both slices on it

    def plan_of(preset, slots, max_len, standby):
        job = from_config_dict({"rollout": {"num_slots": slots, "max_len": max_len, "param_dtype": "bfloat16",
                                            "standby_rows": standby, "max_new_tokens": max_len - 64},
                                "data": {"max_prompt_len": 64}, "train": {"micro_batch_tokens": max_len}})
        return JobMemory.prepare(job, loadgen.model_config(preset, max_len, "bfloat16"), meshes, None)

    tiny = plan_of("tiny", 8, 160, 0)
    real = sum(x.size for x in jax.tree.leaves(nnx.state(random_model(tiny.model), nnx.Param)))
    parts = tiny.plan.parts
    assert tiny.n_params == real and parts["params"] == 4 * real and parts["gradients"] == 4 * real
    assert 0 <= parts["optimizer"] - 8 * real <= 16  # two float32 moments (+ AdamW's step count)
    assert parts["sampler_params"] == 2 * real
    vocab = tiny.model.vocab_size
    kv_bytes = cache_dtype(tiny.model).itemsize  # bf16 keys and values on accelerators, float32 on the CPU
    assert parts["kv_cache"] == 2 * tiny.model.num_layers * 8 * 160 * tiny.model.num_kv_heads * tiny.model.head_dim \
        * kv_bytes + 8 * vocab * 4  # keys and values; plus every slot's float32 logits
    # Qwen2.5-0.5B has 494,032,768 parameters (tied embeddings); bf16 KV: 12 KiB per token (24 KiB in float32).
    big = plan_of("qwen2.5-0.5b", 64, 8256, 32)
    assert big.n_params == 494_032_768
    # slots, standby rows as long as the longest prompt (data.max_prompt_len 64), logits
    kv = (64 * 8256 + 32 * 64) * 24 * 2 * 2 * 64 * kv_bytes + 96 * 151936 * 4
    assert big.plan.parts["kv_cache"] == kv
    big.device_bytes = 16 * GiB
    with pytest.raises(ConfigError, match="The largest part is kv_cache: lower --config.rollout.num_slots"):
        big.plan.check()
    big.device_bytes = 141 * GiB  # one H200: fits
    big.plan.check()


def test_plan_only_prints_the_resident_plan_of_a_preset_and_whether_it_fits(tmp_path, capsys):
    """`--plan-only` at the 0.5B preset on one device: the parts the job checks, the hand-off's second bf16 copy
    among them, against a given memory; a memory too small names the part to shrink instead."""
    bench = _load_benchmark()
    args = ["--preset", "qwen2.5-0.5b", "--plan-only", "--out", str(tmp_path)]
    report = bench.main(args + ["--device_memory_gib", "139"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(report))
    n, sides = report["n_params"], report["memory_sides_bytes"]
    assert n == 494_032_768 and report["fits"] and not report["working_memory_measured"]
    train, rollout = sides["train"], sides["rollout"]
    assert rollout["sampler_params"] == rollout["handoff"]  # the next version's copy beside the current one
    if report["colocated"]:  # one device: every part on it, the hand-off's copy counted once
        assert rollout["handoff"] == 2 * n and train["params"] == 4 * n  # bf16 copies of float32 params
        assert report["memory_total_bytes"] == sum({**train, **rollout}.values())
    else:  # the update writes the copy on the train devices, then the channel moves it
        assert train["handoff"] == train["params"] // 2  # bf16 copy of float32 params, both laid out alike
        assert report["memory_total_bytes"] == max(sum(train.values()), sum(rollout.values()))
    assert report["memory_total_bytes"] <= 0.9 * report["memory_limit_bytes"]
    small = bench.main(args + ["--device_memory_gib", "4"])
    assert not small["fits"] and "The largest part is kv_cache" in small["error"]


def test_the_rate_after_the_first_update_from_hand_made_metrics_rows():
    rate = _load_benchmark().rate_after_first
    rows = [{"time/elapsed_s": 10.0, "trained_tokens_per_s": 100.0},  # 1,000 tokens by the end of update 1
            {"eval/pass": 0.5},  # a row without the loop's figures is skipped
            {"time/elapsed_s": 12.0, "trained_tokens_per_s": 150.0},  # 1,800
            {"time/elapsed_s": 14.0, "trained_tokens_per_s": 200.0}]  # 2,800
    assert rate(rows) == pytest.approx((2800 - 1000) / (14 - 10))
    assert rate(rows[:1]) is None


def test_handoff_latencies_from_a_hand_made_timeline(tmp_path):
    def span(name, tid, ts, dur, **args):
        return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}

    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "sampler"}},
              {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "trainer"}},
              span("decode_step", 1, 0, 100),
              span("publish", 2, 1000, 50),  # version 1
              span("weight_update", 1, 1200, 300, version=1),
              span("decode_step", 1, 1600, 100),  # first step after the swap: ends at 1700
              span("publish", 2, 2000, 50),  # version 2, skipped: version 3 arrived first
              span("publish", 2, 2100, 50),  # version 3
              span("weight_update", 1, 2400, 100, version=3),
              span("decode_step", 1, 2450, 10),  # started before the swap ended: not the first
              span("decode_step", 1, 2600, 40)]
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"traceEvents": events}))
    lat = loadgen.handoff_latencies(str(path))
    assert [x["version"] for x in lat] == [1, 3]
    assert lat[0]["apply_s"] == pytest.approx(500e-6) and lat[0]["first_token_s"] == pytest.approx(700e-6)
    assert lat[1]["apply_s"] == pytest.approx(400e-6) and lat[1]["first_token_s"] == pytest.approx(540e-6)
    busy = loadgen.lane_busy_seconds(str(path))
    assert busy["sampler"]["decode_step"] == pytest.approx(250e-6)


@pytest.mark.slow  # two short runs of the whole job
def test_loop_benchmark_at_toy_size(tmp_path, capsys):
    bench = _load_benchmark()
    report = bench.main(["--preset", "tiny", "--steps", "2", "--etas", "0,1", "--median", "6", "--cap", "16",
                         "--slots", "8", "--group_size", "2", "--batch_groups", "2", "--warmup_steps", "0",
                         "--out", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(report))  # the last line is the JSON report
    assert [r["eta"] for r in report["results"]] == [0, 1]
    # With no warm-up the first run traces (and compiles or loads) every program it runs.
    first = report["results"][0]
    assert first["compile_s"] > 0 and first["compile_share"] == pytest.approx(first["compile_s"] / first["wall_s"])
    lengths = loadgen.long_tail_lengths(4096, 6, 16, seed=0)

    def check(r):
        for key in ("trained_tokens_per_s", "trained_tokens_per_s_after_first", "generated_tokens_per_s",
                    "slot_occupancy", "trainer_wait_share",
                    "staleness_mean", "staleness_max", "handoff_first_token_s_mean", "publish_s_mean"):
            assert r[key] is not None, key
        assert r["steps"] == 2 and 0 < r["slot_occupancy"] <= 1 and 0 <= r["trainer_wait_share"] < 1
        run_dir = tmp_path / f"eta{r['eta']}"
        rows = [json.loads(ln) for ln in open(run_dir / "samples.jsonl")]
        assert len(rows) == 2 * 2  # two updates of two groups
        stale = [row["trained_version"] - row["min_token_version"] for row in rows]
        assert max(stale) <= r["eta"] and r["staleness_max"] == max(stale)
        # Every trained completion had exactly its drawn length (no stop token, no clipping).
        assert r["completion_tokens_trained"] == sum(2 * lengths[row["gid"]] for row in rows)
        assert (run_dir / "timeline.json").exists()
        # The random logits were tempered (--entropy 1.0 by default): the trained tokens are not near-certain ones,
        # so a group's samples differ (untempered, this model's tokens carried ~1e-10 nats and every group scored alike).
        assert 0.3 < r["entropy_mean"] < 3 and 0 <= r["uniform_group_fraction"] <= 1 and r["grad_norm_mean"] >= 0

    for r in report["results"]:
        check(r)
    h = report["results"][-1]["handoff"]
    assert h["bytes_moved"] == 2 * report["n_params"] and h["source_bytes"] == 4 * report["n_params"]
    assert h["handoff_s"] > 0 and h["raw_copy_s"] > 0 and h["ratio_vs_raw_copy"] > 0
    # Sharing the devices, the job hands its trainer's update-written copy over as it is; split, it copies it.
    assert h["job_handoff_copied"] is not h["colocated"]
    assert report["results"][0]["memory_actual"]["sampler_params"] == report["memory_plan_bytes"]["sampler_params"]
    # Run again into the same directory: the figures are this run's alone (the job appends to its files).
    again = bench.main(["--preset", "tiny", "--steps", "2", "--etas", "0", "--median", "6", "--cap", "16",
                        "--slots", "8", "--group_size", "2", "--batch_groups", "2", "--warmup_steps", "0",
                        "--out", str(tmp_path)])
    check(again["results"][0])


def test_loop_benchmark_rejects_bad_flags(capsys):
    bench = _load_benchmark()
    with pytest.raises(SystemExit):
        bench.parse_args(["--etas", "0,x"])
    assert "--etas='0,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--micro_batch_tokens", "10"])
    assert "--micro_batch_tokens=10 is below the longest sequence" in capsys.readouterr().err
