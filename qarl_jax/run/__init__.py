"""A training run's lifecycle, from a config to a finished run directory (``python -m qarl_jax.main``
drives it; the parts below are what it calls, in the order a run meets them).

- :mod:`~qarl_jax.run.distributed`: joining the hosts (``jax.distributed``; a Cloud TPU slice detected)
- :mod:`~qarl_jax.run.build`: the policy, tokenizer, engine and checkpoint from a config
- :mod:`~qarl_jax.run.rundir`: the run directory (checked before any work; the run lock)
- :mod:`~qarl_jax.run.hosts`: every host sees the same run directory, or none starts
- :mod:`~qarl_jax.run.checkpoint`: orbax checkpoints, the damaged-checkpoint fallback
- :mod:`~qarl_jax.run.train`: the RL loop
- :mod:`~qarl_jax.run.preemption`: a SIGTERM or JAX's notice stops every host at one saved step
- :mod:`~qarl_jax.run.heldout_eval`: the in-loop held-out evaluation (the command is
  :mod:`qarl_jax.evaluate`)
- :mod:`~qarl_jax.run.runlog`: metrics.jsonl, TensorBoard and reading a run back
- :mod:`~qarl_jax.run.progress`, :mod:`~qarl_jax.run.heap`: the progress line, malloc thresholds

Nothing is imported here: each module is imported by name, so ``import qarl_jax.run.rundir`` does not
pull in JAX's training stack.
"""
