"""Prompt templates: how a question becomes the text the policy continues.

``qwen3_chat`` reproduces what Qwen3's ``apply_chat_template`` renders for one user turn with
``add_generation_prompt=True`` (thinking left on), with the usual math instruction appended.
"""

from __future__ import annotations

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def plain(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def qwen3_chat(question: str) -> str:
    return f"<|im_start|>user\n{question}\n{BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"


TEMPLATES = {"plain": plain, "qwen3_chat": qwen3_chat}


def apply_template(name: str, question: str) -> str:
    """Render ``question`` with the template ``name`` (see :data:`TEMPLATES`)."""
    if name not in TEMPLATES:
        raise ValueError(f"template: unknown {name!r}, expected one of {sorted(TEMPLATES)}")
    return TEMPLATES[name](question)
