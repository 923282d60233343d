"""The learning half of QaRL: advantages, policy-gradient objectives (TBPO, GRPO, GSPO, ...),
the policy log-prob function and the training step."""
