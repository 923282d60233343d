"""The learning half of QaRL: the policy log-prob function (aligned / naive), advantages,
policy-gradient objectives (TBPO, GRPO, GSPO, ...), rollout-to-batch packing and the train step."""
