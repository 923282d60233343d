"""Prompt templates: how a question becomes the text the policy continues.

``qwen3_chat`` reproduces what Qwen3's ``apply_chat_template`` renders for one user turn with
``add_generation_prompt=True`` (thinking left on), with the usual math instruction appended.

A template may need stop strings besides the EOS token (:data:`STOP_STRINGS`): after ``plain``'s
"Question: ...\nAnswer:" a base model that has answered often goes on to a made-up next
"Question:" and answers that too, and the grader would read the last answer. Rollouts (training,
the held-out eval, ``python -m qarl_jax.evaluate``) stop there, as lm-eval's GSM8K task stops at
``until: ["Question:", ...]``, and the response is graded up to it (:func:`cut_at_stop`).
``qwen3_chat`` ends on ``<|im_end|>``, the EOS token: it needs none.
"""

from __future__ import annotations

from collections.abc import Sequence

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def plain(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def qwen3_chat(question: str) -> str:
    return f"<|im_start|>user\n{question}\n{BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"


TEMPLATES = {"plain": plain, "qwen3_chat": qwen3_chat}
STOP_STRINGS: dict[str, tuple[str, ...]] = {"plain": ("Question:",), "qwen3_chat": ()}


def apply_template(name: str, question: str) -> str:
    """Render ``question`` with the template ``name`` (see :data:`TEMPLATES`)."""
    if name not in TEMPLATES:
        raise ValueError(f"template: unknown {name!r}, expected one of {sorted(TEMPLATES)}")
    return TEMPLATES[name](question)


def stop_strings(name: str) -> tuple[str, ...]:
    """The stop strings rollouts of template ``name`` end on (see the module docstring)."""
    if name not in STOP_STRINGS:
        raise ValueError(f"template: unknown {name!r}, expected one of {sorted(STOP_STRINGS)}")
    return STOP_STRINGS[name]


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to its first stop string (the rollout keeps the token that completed it, whose
    text is not part of the answer), or all of it."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]
