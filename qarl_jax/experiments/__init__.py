"""Experiments built from ordinary training runs (``python -m qarl_jax.experiments.replicate``)."""
