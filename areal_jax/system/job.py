"""RLJob: builds every part of a run from a validated config, runs the loop, and cleans up.

    job = RLJob(config)          # meshes, model, trainer, sampler, rewards, data, resume
    summary = job.run()          # async (or eta = 0 synchronous) RL until total_steps
    job.close()

or `with RLJob(config) as job: job.run()`. Each part gets its collaborators at construction and is
registered on an ExitStack as soon as it exists, so a failure half-way through construction closes
exactly what was opened (reward workers, the sampler thread, logs), in reverse order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from areal_jax import config as config_lib
from areal_jax import knobs, paths
from areal_jax.checkpoint import Checkpointer, example_to_json, write_json
from areal_jax.config import JobConfig
from areal_jax.data.sources import source_summary
from areal_jax.rewards.config import MATH_REWARD_WARMUP  # noqa: F401  (re-exported: what a math worker scores first)
from areal_jax.runtime import multihost
from areal_jax.sampler.turns import FeedbackTurns, repair_turn_notes
from areal_jax.system import gather, runner, user_errors
from areal_jax.system.buffer import TrajectoryBuffer
from areal_jax.system.controller import RolloutController
from areal_jax.system.hf_export import HFExporter
from areal_jax.system.interfaces import ManagedSampler
from areal_jax.system.parts import load_policy, rollout_channel, rollout_source
from areal_jax.trainer.resume import restore_train_state

# The per-step values the end-of-run summary reads; only these are kept for every step.
SUMMARY_KEYS = ("reward", "staleness", "staleness_max", "sampler/occupancy", "tokens_per_s",
                "trained_tokens_per_s")


class RLJob:
    """One RL run: construct with a config (a JobConfig, or a ConfigDict validated here), call run(),
    then close() (or use it as a context manager)."""

    def __init__(self, config: JobConfig | ConfigDict, *, log_fn: Callable[..., None] = print,
                 machine: dict | None = None):
        """machine: facts about the host recorded in summary.json (e.g. {"matmul_peak_gflops": 96.0})."""
        self._t_created = time.perf_counter()
        self.machine = dict(machine or {})
        self._eval_seconds = 0.0
        self._ckpt_seconds = [0.0, 0.0]  # the trainer held by saves; saves from start to complete
        self.config = config_lib.validate(config)
        self._exit = contextlib.ExitStack()
        try:
            self._build(log_fn)
        except BaseException:
            self._exit.close()  # what was opened so far, newest first
            raise

    def __enter__(self) -> "RLJob":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads and worker processes and flush every log; a second call does nothing."""
        self._exit.close()

    def _build(self, log_fn: Callable[..., None]) -> None:
        from areal_jax import metrics
        from areal_jax.data.sources import load_train_prompts, source_names
        from areal_jax.models.config import ModelConfig
        from areal_jax.runtime.distributed import is_primary
        from areal_jax.runtime.mesh import build_meshes
        from areal_jax.sampler.replicas import make_sampler
        from areal_jax.system.memory import JobMemory
        from areal_jax.tokenizer import Tokenizer

        c, close_later = self.config, self._exit
        self.primary = is_primary()
        self.log = log_fn if self.primary else (lambda *a, **k: None)
        with user_errors.run_dir(c.run_dir):
            paths.makedirs(c.run_dir)  # local, file:// or object store (areal_jax.paths)
            if self.primary:
                paths.write_text(paths.join(c.run_dir, "config.json"), c.to_json())

        try:  # device counts: still before anything is loaded or compiled
            self.meshes = build_meshes(c.mesh)
            self.local_groups = multihost.local_batch_groups(c.train.batch_groups, jax.process_count())
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from e
        with user_errors.tokenizer_dir(c.model.path, c.model.tokenizer_path):
            self.tokenizer = Tokenizer.from_pretrained(c.model.tokenizer_path or c.model.path)
        self.tokenizer.template_variables.update(c.data.template_variables)
        try:  # repair turns: the chat template's frame read and the loss checked, before anything compiles
            for line in repair_turn_notes(c, self.tokenizer):
                self.log(line)
        except ValueError as e:
            raise config_lib.ConfigError(f"--config.rollout.{e}") from e
        # The data next, so a bad dataset fails before the model is loaded and anything compiles.
        d = c.data
        self.prompts = load_train_prompts(  # several files: a mixture (data.sources), each step logs each one
            d, self.tokenizer, seed=c.seed, process_index=jax.process_index(), process_count=jax.process_count(),
            on_file=lambda path: user_errors.data_file("data.train_path", path))
        self.source_names = source_names(d)
        self.eval_sets: dict[str, list] = {}  # {set name: prompts} (evaluation.sets; one set unless test_path lists more)
        if c.eval.enabled and d.test_path:
            from areal_jax.evaluation.sets import load_eval_sets

            self.eval_sets = load_eval_sets(d.test_path, self.tokenizer, d, c.eval.n_test,
                                            on_file=lambda path: user_errors.data_file("data.test_path", path))
        self._evaluator = None  # evaluation.in_job.JobEvaluator, built at the first evaluation
        self.skipped_rows = {"malformed": self.prompts.num_bad_rows_skipped,
                             "too_long": self.prompts.num_too_long_skipped}
        if any(self.skipped_rows.values()):
            self.log(f"Data: skipped {self.skipped_rows['malformed']} malformed rows and "
                     f"{self.skipped_rows['too_long']} prompts longer than data.max_prompt_len="
                     f"{d.max_prompt_len} tokens.")
        # Metrics sinks before the model loads, so a W&B login problem costs seconds (start_step: mark_loop_start).
        self.metrics = metrics.MetricsLogger(c.run_dir, enabled=self.primary, total_steps=c.total_steps,
                                             tensorboard=c.log.tensorboard, wandb=c.log.wandb_settings(knobs.to_dict(c), self.log))
        close_later.callback(self.metrics.close)
        dtype, param_dtype = c.model.compute_dtype, c.model.storage_dtype
        with user_errors.model_dir(c.model.path):  # every resident part per device, checked before loading
            model_cfg = ModelConfig.from_pretrained(c.model.path, dtype=dtype, param_dtype=param_dtype).replace(
                **c.model.run_choices())
        if c.train.router_replay != "off" and not model_cfg.num_experts:
            raise config_lib.ConfigError(f"--config.train.router_replay={c.train.router_replay} needs a mixture-of-experts "
                                         f"model; {c.model.path} has no experts. Set it to off.")
        if c.train.router_bias_rate > 0 and not model_cfg.router_score_bias:
            raise config_lib.ConfigError(f"--config.train.router_bias_rate={c.train.router_bias_rate} moves a router's "
                                         f"picking bias (DeepSeek-V3's e_score_correction_bias); {c.model.path}'s "
                                         "routers have none. Set it to 0.")
        self.memory = JobMemory.for_job(c, model_cfg, self.meshes, log=self.log)
        train_cfg = self.memory.resolve_update(c.train, self.meshes.train_mesh)  # train.remat chosen, plan checked
        if self.memory.model.expert_dispatch != c.model.expert_dispatch:  # "auto" resolved by the plan
            c = self.config = dataclasses.replace(c, model=dataclasses.replace(
                c.model, expert_dispatch=self.memory.model.expert_dispatch))
        self.rollout_cfg = self.memory.resolve_rollout(c, self.meshes.replica_meshes[0])  # sampler programs, kv_pages
        self.log(f"Device memory: {self.memory.plan.describe()}; train.remat={train_cfg.remat}, rollout.kv_pages="
                 f"{self.rollout_cfg.kv_pages}")
        r, t = self.meshes.rollout_mesh.devices.shape
        self.log(f"Loading {c.model.path} onto the train mesh {dict(self.meshes.train_mesh.shape)} (rollout: {r} "
                 f"replica{'s' * (r > 1)} x {t} tensor device{'s' * (t > 1)}) ...")
        model, self.trainer = load_policy(c, self.meshes, train_cfg)
        self.model_config = model.cfg
        self.policy_graphdef = nnx.graphdef(model)  # the trainer's params' graph (adapters too; the sampler's may not)
        lora_cfg = c.lora if c.lora.enabled else None

        self.checkpoint_clock = runner.CheckpointClock(c.checkpoint.every_steps, c.checkpoint.every_minutes)
        self.checkpointer = Checkpointer(c.run_dir, keep=c.checkpoint.keep, async_save=c.checkpoint.async_save,
                                         on_written=self._checkpoint_written, log=log_fn)  # every host's own
        close_later.callback(self.checkpointer.close)
        self.hf_export = HFExporter(c.run_dir, self.tokenizer, c.checkpoint, log=log_fn, source=c.model.path,
                                    lora_scale=None if lora_cfg is None else lora_cfg.scale)
        close_later.callback(self.hf_export.close)
        self.sample_log = runner.SampleLog(c.run_dir)  # one file per process when there are several
        close_later.callback(self.sample_log.close)
        self._digest_log = None
        if c.log.param_digests:
            self._digest_log = paths.AppendFile(
                paths.join(c.run_dir, f"params_digests.process_{jax.process_index()}.jsonl"))
            close_later.callback(self._digest_log.close)
        meta = self._maybe_resume()
        # Only process 0 writes timeline.json (the others record nothing and save nothing).
        self.timeline = metrics.Timeline(paths.join(c.run_dir, "timeline.json") if self.primary else None,
                                         enabled=self.primary and c.log.timeline,
                                         max_events=c.log.timeline_max_events)
        close_later.callback(self.timeline.close)  # saves timeline.json and removes its spool

        r = self.rollout_cfg
        self.channel, self.graphdef = rollout_channel(c, model, self.trainer, self.meshes, r)
        rollout_params = self.channel.reshard(**rollout_source(self.trainer, self.channel))
        self.sampler: ManagedSampler = make_sampler(  # one SamplerLoop per rollout replica (sampler.replicas)
            r, model if lora_cfg is None else self.graphdef, self.meshes.rollout_mesh, rollout_params,
            config=model.cfg, version=self.trainer.version, on_update=r.on_update, decode_steps=r.decode_steps,
            seed=c.seed + 7919 * self.trainer.version + 104729 * jax.process_index(), timeline=self.timeline,
            record_routes=c.train.router_replay != "off")  # the experts of each finished sample (sampler.routes)
        self.engine = getattr(self.sampler, "engines", [getattr(self.sampler, "engine", None)])[0]  # replica 0's
        if getattr(self.engine, "decode_choice", None) is not None and self.engine.decode_choice.seconds:
            knob = "paged_attention" if c.rollout.kv_cache == "paged" else "decode_attention"
            self.log(f"Decode attention (rollout.{knob}={getattr(c.rollout, knob)}): "
                     f"{self.engine.decode_choice.describe()}")
        close_later.callback(self.sampler.stop, graceful=False)
        self.reward_pool = c.reward.make_pool()
        close_later.callback(self.reward_pool.close)
        if c.reward.fn in ("code", "mixed"):
            from areal_jax.rewards.isolation import sandbox_layers

            self.log(f"Code sandbox: {sandbox_layers()}.")
        resubmit, accepted, first_gid, retirement = [], 0, 0, None
        if meta is not None:
            from areal_jax.data import PromptExample

            if meta.get("prompts_state") is not None:
                self.prompts.set_state(meta["prompts_state"])
            resubmit = [PromptExample(**d) for d in meta["pending"]]
            accepted = self.trainer.version * self.local_groups
            first_gid = int(meta["next_gid"])
            retirement = meta.get("retirement")
        self.buffer = TrajectoryBuffer(first_gid=first_gid)
        self.controller = RolloutController(
            r, self.sampler, self.reward_pool, self.prompts, self.tokenizer.decode, self.buffer,
            batch_groups=self.local_groups, stop_token_ids=tuple(self.tokenizer.eos_token_ids),
            resubmit=resubmit, accepted=accepted, first_gid=first_gid, timeline=self.timeline,
            turns=FeedbackTurns.for_job(c, self.tokenizer), retirement=retirement,
        )
        close_later.callback(self.controller.stop)
        self.stop = runner.StopFlag()
        close_later.callback(self.stop.restore)  # the caller's own Ctrl-C / SIGTERM handling again
        self.evaluations: dict[str, dict] = dict(meta.get("evaluations") or {}) if meta is not None else {}

    # ---- resume -----------------------------------------------------------------------------------
    def _maybe_resume(self) -> dict | None:
        step = self.checkpointer.latest_step() if self.config.checkpoint.resume else None
        if step is None:
            # A fresh start: lines left by an earlier attempt that died before its first checkpoint
            # would otherwise be trained (and logged) twice.
            self.sample_log.truncate_from(0)
            return None
        c = self.config
        try:
            state, meta, converted = restore_train_state(self.checkpointer, step, self.trainer.state,
                                                         self.trainer.cfg)
        except (ValueError, TypeError, KeyError) as e:  # shapes or structure of another model
            raise user_errors.restore_failed(e, c.run_dir, c.model.path) from e
        user_errors.check_same_model(meta.get("model"), user_errors.model_signature(self.model_config), c.run_dir,
                                     c.model.path)
        self.trainer.restore(state, meta)  # its state, and the micro-step shapes of the run this one continues
        self.log(f"Resumed from checkpoint step {step} (policy version {self.trainer.version})"
                 + (f"; {converted}." if converted else "."))
        self.sample_log.truncate_from(self.trainer.version)
        return meta

    def save_checkpoint(self) -> None:
        if self.checkpointer.has_step(self.trainer.version):
            return  # this version is saved or being saved (e.g. the periodic save of the last step)
        snap = self.controller.snapshot()
        meta = {
            "version": self.trainer.version, "next_gid": self.buffer.next_gid,
            "pending": [example_to_json(e) for e in snap["pending"]], "prompts_state": snap["prompts_state"],
            "counters": snap["counters"], "retirement": snap["retirement"], "seed": self.config.seed,
            "saved_at": time.time(),
            "model": user_errors.model_signature(self.model_config),
            "evaluations": self.evaluations,  # a resumed run still reports its start evaluation
            **self.trainer.checkpoint_meta(),  # the trainer's book of compiled shapes ("layouts")
        }
        with self.timeline.span("checkpoint", lane="trainer"):
            self.sample_log.sync()  # on an object store: a resume must find every line it restores
            self.metrics.flush()
            self.checkpointer.save(self.trainer.version, self.trainer.state, meta)
        self.checkpoint_clock.saved()
        self._ckpt_seconds[0] += self.checkpointer.last_blocked_s

    def _checkpoint_written(self, step: int, seconds: float) -> None:  # from orbax's thread when asynchronous
        self._ckpt_seconds[1] += seconds
        if getattr(self, "timeline", None) is not None:
            self.timeline.complete("checkpoint_write", seconds, lane="checkpoint", step=step)

    # ---- evaluation -------------------------------------------------------------------------------
    def evaluate(self, tag: str) -> dict | None:
        from areal_jax.evaluation.in_job import JobEvaluator, result_lines
        from areal_jax.evaluation.sets import metric_items

        c = self.config
        if c.eval.n_test <= 0 or not c.data.test_path:
            return None
        params = self.channel.reshard(**rollout_source(self.trainer, self.channel))  # a collective: every process takes part
        if not self.primary:
            return None
        if self._evaluator is None:  # one engine per rollout replica
            self._evaluator = JobEvaluator(c, self.graphdef, self.model_config, self.tokenizer, self.eval_sets,
                                           self.meshes.rollout_mesh)
        with self.timeline.span(f"eval_{tag}", lane="trainer"):
            res = self._evaluator.run(params, self.reward_pool, tag, log=self.log)
        self.evaluations[tag] = res
        self._eval_seconds += res["seconds"]
        for line in result_lines(tag, res):
            self.log(line)
        self.metrics.log(self.trainer.version, metric_items(res))
        return res

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.config
        self.stop.install()
        if c.train.warm_up:  # the update compiles while the sampler runs
            self.trainer.warm_up(c.rollout.max_len - 1, background=True, log=self.log)
        if c.eval.at_start and self.trainer.version == 0:
            self.evaluate("start")
        self.controller.start()
        t_start = time.perf_counter()
        self.metrics.mark_loop_start(self.trainer.version)  # the ETA's rate: steps run since (re)start
        trained_tokens, last_gen = 0, 0
        history = []
        while self.trainer.version < c.total_steps:
            t0 = time.perf_counter()
            with self.timeline.span("wait_batch", lane="trainer"):
                groups = runner.wait_for_batch(
                    self.buffer, self.local_groups, self.controller, self.sampler, self.stop, timeout_s=1800
                )
            if groups is None:
                break
            t_wait = time.perf_counter() - t0
            version = self.trainer.version
            summary = {**runner.batch_summary(groups, version), **source_summary(groups, self.source_names)}
            trajectories = gather.allgather_trajectories(runner.groups_to_trajectories(groups))
            with self.timeline.span("train_step", lane="trainer", version=version):
                tm = self.trainer.update(trajectories)
            with self.timeline.span("publish", lane="trainer"):
                published = self.channel.publish(self.trainer.version, **rollout_source(self.trainer, self.channel))
                self.sampler.update_params(published, self.trainer.version)  # swapped in between two decode steps
            self.sample_log.write(groups, version)
            if c.log.param_digests:
                runner.record_digests(self.trainer, self.channel, self.sampler, self._digest_log)
            trained_tokens += int(sum(len(t.tokens) for t in trajectories))
            elapsed = time.perf_counter() - t_start
            stats = self.sampler.stats()
            gen = int(stats.get("generated_tokens", 0))
            m = {**summary, **{f"train/{k}": float(v) for k, v in tm.items()},
                 "time/wait_batch_s": t_wait, "time/step_s": time.perf_counter() - t0,
                 "time/elapsed_s": elapsed, "tokens_per_s": gen / max(elapsed, 1e-9),
                 "trained_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
                 "sampler/occupancy": float(stats.get("mean_slot_occupancy", 0.0)),
                 "sampler/step_tokens": gen - last_gen,
                 "sampler/placed_from_standby": float(stats.get("placed_from_standby", 0)),
                 "sampler/preempted": float(stats.get("preempted", 0)),
                 "publish/s": self.channel.last_publish_s, "publish/bytes": float(self.channel.last_bytes),
                 **{f"rollout/{k}": float(v) for k, v in self.controller.counters.items()},
                 **{f"rollout/{k}": float(v) for k, v in self.controller.retirement.counts().items()},
                 **self.buffer.sizes()}
            last_gen = gen
            history.append({k: m[k] for k in SUMMARY_KEYS if k in m})  # bounded per step (long runs)
            step = self.trainer.version
            if c.log.every_steps and step % c.log.every_steps == 0:
                self.metrics.log(step, m)
                if c.log.console:
                    self.log(self.metrics.progress_line(step, m))
            if c.eval.every_steps and step % c.eval.every_steps == 0 and step < c.total_steps:
                self.evaluate(f"step{step}")
            if self.checkpoint_clock.due(step):
                self.save_checkpoint()
            self.hf_export.maybe_export(lambda: nnx.merge(self.policy_graphdef, self.trainer.params), step)
        interrupted = self.stop.requested.is_set()
        self.controller.stop()
        self.sampler.stop(graceful=False)
        wall = time.perf_counter() - t_start
        self.save_checkpoint()
        self.hf_export.maybe_export(lambda: nnx.merge(self.policy_graphdef, self.trainer.params), self.trainer.version, True)
        if not interrupted and c.eval.at_end:
            self.evaluate("end")  # beside the last checkpoint's (and HF directory's) write
        self.checkpointer.wait()
        self.hf_export.wait()
        return self._summary(history, wall, interrupted)

    def _summary(self, history: list[dict], wall: float, interrupted: bool) -> dict:
        def pick(key):
            return [h[key] for h in history if key in h]

        rewards = pick("reward")
        q = max(1, len(rewards) // 4)
        out = {
            "steps": self.trainer.version, "wall_s": wall, "interrupted": interrupted,
            "reward_first_quarter": float(np.mean(rewards[:q])) if rewards else None,
            "reward_last_quarter": float(np.mean(rewards[-q:])) if rewards else None,
            "tokens_per_s": history[-1]["tokens_per_s"] if history else None,
            "trained_tokens_per_s": history[-1]["trained_tokens_per_s"] if history else None,
            "staleness_mean": float(np.mean(pick("staleness"))) if history else None,
            "staleness_max": float(np.max(pick("staleness_max"))) if history else None,
            "sampler_occupancy": float(np.mean(pick("sampler/occupancy"))) if history else None,
            "evaluations": self.evaluations,
            "skipped_rows": self.skipped_rows, "retired_tasks": self.controller.retirement.counts(),
            "remat": self.trainer.cfg.remat,
            "memory_plan_bytes": self.memory.plan.parts, "device_memory_bytes": self.memory.device_bytes,
            **self.machine,
        }
        job_wall = time.perf_counter() - self._t_created
        out.update({"job_wall_s": job_wall, "eval_s": self._eval_seconds,
                    "eval_share": self._eval_seconds / max(job_wall, 1e-9),
                    "checkpoint_blocked_s": self._ckpt_seconds[0], "checkpoint_write_s": self._ckpt_seconds[1],
                    "checkpoint_blocking_fallbacks": self.checkpointer.blocking_fallbacks})
        if self.primary:
            write_json(paths.join(self.config.run_dir, "summary.json"), out)
        return out
