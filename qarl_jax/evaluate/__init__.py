"""``python -m qarl_jax.evaluate``: a checkpoint x benchmark files -> the paper's table (see
:mod:`qarl_jax.evaluate.command`). :mod:`~qarl_jax.evaluate.benchmarks` reads the files,
:mod:`~qarl_jax.evaluate.run` loads the policy and samples and grades, and
:mod:`~qarl_jax.evaluate.metrics` turns the grades into figures. (The held-out eval inside a
training run is :mod:`qarl_jax.run.heldout_eval`.)"""
