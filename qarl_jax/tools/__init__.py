"""User tools run as ``python -m qarl_jax.tools.<name>``: ``check_alignment`` measures the
training-inference mismatch of a policy (rollout engine vs the trainer's loss)."""
