"""Row-wise operations (RMSNorm, RoPE, the tempered log-sum-exp and what derives from it):
``api`` (public functions, custom VJPs), ``reference``, ``cpu`` / ``gpu`` / ``tpu`` kernels,
``common`` (the per-row arithmetic the three paths share)."""

from kernels_pallas.rowwise.api import (
    default_block_v,
    log_softmax,
    logsumexp,
    rms_norm,
    rope,
    softmax,
    token_logprobs,
)
from kernels_pallas.rowwise.reference import reference_logsumexp, reference_rms_norm, reference_rope

__all__ = [
    "default_block_v",
    "log_softmax",
    "logsumexp",
    "reference_logsumexp",
    "reference_rms_norm",
    "reference_rope",
    "rms_norm",
    "rope",
    "softmax",
    "token_logprobs",
]
