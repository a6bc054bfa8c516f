"""Evaluation of a policy on a split: one sampler pass over the greedy and sampled sequences (`batch`)
and the pass@1 / pass@k scoring around it (`scoring`), used by the job and by the evaluate program."""
