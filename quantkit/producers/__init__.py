"""Producers: one module per format family, each with the same shape (see :mod:`quantkit.producers.base`).

Which producer makes which spec is the formats registry's business (:mod:`quantkit.formats`, the ``producer``
of each row); modules are imported only when used, so a missing backend only matters to the verbs that need it.
"""

from __future__ import annotations

import importlib

from quantkit import formats
from quantkit.formats.specs import MethodBase
from quantkit.producers.base import Producer


def get(spec: MethodBase) -> Producer:
    """The producer that makes ``spec`` (its registry row's module)."""
    return importlib.import_module(formats.for_spec(spec).producer).PRODUCER
