"""The fast tier's share of a parametrized test: :func:`slow_but` marks every case ``slow`` but the
named ones, so ``pytest -m "not slow"`` runs one representative case (the default format, the
cheapest shape that takes every path) and the whole suite runs them all. A module of its own (not
conftest): the suite's modules import it as they import ``pallas_cases``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def slow_but(values: Iterable[Any], *fast: Any, several: bool = False) -> list[Any]:
    """``values`` for ``pytest.mark.parametrize``, each one not in ``fast`` marked ``slow``;
    ``several``: each value is a tuple of several arguments' values (else one argument's)."""
    slow = pytest.mark.slow
    return [v if v in fast else pytest.param(*(v if several else (v,)), marks=slow) for v in values]
