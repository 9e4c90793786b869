"""Parsers by name (the tool-call parsers' and the reasoning parsers' registries), and the Python files that
add users' own (vLLM's --tool-parser-plugin and --reasoning-parser-plugin).

A plugin is a Python file run once per process, whose class decorators (``register_tool_parser``,
``register_reasoning_parser``) add its parsers under their ``name``. It runs wherever a ServerConfig naming
it is made: the server's process, which reads every answer, and so each data-parallel replica too (the
engine process never parses). A name registered again is the later class's, as vLLM's
register_module(force=True): a plugin may replace a built-in parser, and a warning says so.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

# Plugins' module names: the file's stem after this, so that a plugin called json.py shadows no module.
PLUGIN_MODULE_PREFIX = "plait_parser_plugin_"
# The plugins run in this process, by resolved path: a file named twice (by both flags, or by the configs a
# server makes of one) runs once, as an import would.
_PLUGINS: dict[Path, ModuleType] = {}

P = TypeVar("P", bound=type)


class ParserRegistry(dict[str, P], Generic[P]):
    """One kind of parser's classes by their ``name`` class attribute (a dict: name -> class)."""

    def __init__(self, kind: str, base: type) -> None:
        super().__init__()
        self.kind = kind  # how errors name one, e.g. "tool call parser"
        self.base = base

    def register(self, cls: P) -> P:
        """Class decorator: makes ``cls`` (a subclass of the base) available under its ``name``; a name
        registered before becomes this class's."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"a {self.kind} must be a subclass of {self.base.__name__}, got {cls!r}")
        name = cls.__dict__.get("name")  # its own: a subclass inheriting its parent's would take its place
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} {cls.__qualname__} needs a name of its own: a class attribute "
                             "name = '...' (what the command line calls it)")
        old = self.get(name)
        if old is not None and _class_path(old) != _class_path(cls):
            logger.warning("%s %r is now %s (was %s)", self.kind, name, _class_path(cls), _class_path(old))
        self[name] = cls
        return cls

    def lookup(self, name: str) -> P:
        """The class registered under ``name``; a ValueError naming the known ones otherwise."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self))}")
        return self[name]

    def load(self, name: str | None, plugin: str | None = None) -> P | None:
        """The class a server configured with ``name`` (None: no parser) and ``plugin`` (a Python file that
        may register it) uses: the plugin run first, so that an unknown name, a missing plugin or one that
        fails are ValueErrors at start-up."""
        if plugin is not None:
            load_plugin(plugin, f"{self.kind} plugin")
        return None if name is None else self.lookup(name)


def load_plugin(path: str, what: str = "parser plugin") -> ModuleType:
    """Run the Python file at ``path`` once in this process (its decorators register its parsers) and return
    its module; a file that is missing or raises is a ValueError naming it (``what`` it is) and where it
    failed."""
    resolved = Path(path).expanduser().resolve()
    if resolved in _PLUGINS:
        return _PLUGINS[resolved]
    if not resolved.is_file():
        raise ValueError(f"the {what} {path!r} {'is not a file' if resolved.exists() else 'does not exist'}")
    name = _module_name(resolved)
    # The loader named outright: a file of any suffix runs (spec_from_file_location guesses by ".py").
    loader = importlib.machinery.SourceFileLoader(name, str(resolved))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    sys.modules[name] = module  # as an import: its classes pickle, its dataclasses resolve their module
    try:
        loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - whatever a user's file raises is its failure to load
        del sys.modules[name]
        raise ValueError(f"the {what} {path!r} failed to load{_where(err, resolved)}: "
                         f"{type(err).__name__}: {err}") from err
    _PLUGINS[resolved] = module
    return module


def _module_name(path: Path) -> str:
    """A module name for the plugin at ``path`` that no module already loaded has."""
    base = PLUGIN_MODULE_PREFIX + path.stem
    name, n = base, 1
    while name in sys.modules:
        n += 1
        name = f"{base}_{n}"
    return name


def _where(err: BaseException, path: Path) -> str:
    """' (line N)': the plugin's last line the error passed through (a SyntaxError names its own line)."""
    frames = traceback.extract_tb(err.__traceback__)
    lines = [frame.lineno for frame in frames if Path(frame.filename) == path]
    return f" (line {lines[-1]})" if lines else ""


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
