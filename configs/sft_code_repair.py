"""Warm start for repair turns: `python -m areal_jax.programs.sft --config=configs/sft_code_repair.py`.

Continues the code default's warm start (assets/code_reasoner) on the same synthetic tasks, with half of the rows
two attempts long: a wrong program (a look-alike task's or a slipped constant), the execution feedback a rollout's
repair turn shows after it ("f(10) returned -30, expected 30."), then the correct program, the loss on the repair
only (data/code_synthetic.repair_target). The other half keeps the code default's mix of mostly wrong first
attempts, so the greedy first attempt stays mostly wrong while a repair can read the feedback: configs/code_repair.py
then trains both by reinforcement learning with one repair turn.
"""
import ml_collections

from areal_jax.knobs import load_config_file


def get_config() -> ml_collections.ConfigDict:
    c = load_config_file("sft_code.py", __file__)
    c.init_from = "assets/code_reasoner"
    c.out_dir = "assets/code_repairer"
    c.seq_len = 240  # the longest two-attempt row of the 1,000 train tasks
    c.max_new_tokens = 160  # first attempt + feedback + repair
    repair = ml_collections.ConfigDict(dict(
        name="repair", mix={"repair": 0.5, "confused": 0.4, "slip": 0.1}, lr=3e-4,
        warmup_steps=10, max_steps=200, max_minutes=20.0, eval_every=100, stop_above=None, stop_below=None))
    c.stages = [repair]
    return c
