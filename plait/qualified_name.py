"""Objects named by qualified names (``module:Class`` or ``module.Class``), as vLLM's flags name them."""

from __future__ import annotations

import importlib
from typing import Any


def import_qualified(qualified: str, what: str) -> Any:
    """The object ``qualified`` names, as ``module:attr`` or ``module.attr`` (``attr`` may be dotted under the
    colon form); ``what`` names its role in the ValueError for a name that does not import."""
    module_name, sep, attribute = qualified.partition(":")
    if not sep:
        module_name, _, attribute = qualified.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"{what} {qualified!r} must name a class as module:Class or module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {qualified!r}: cannot import {module_name!r} ({e})") from e
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {qualified!r}: {module_name!r} has no {attribute!r}")
        obj = getattr(obj, part)
    return obj
