"""Builds the reference module (vllm-mlx's ``vllm_mlx/ssd_cache.py``) at run
time from its API documentation, ``seed/ssd_cache_reference.txt`` in the
shared directory beside the repository, so the project never holds a copy of
the reference's code.

The seed documents the module member by member: a heading line
``vllm_mlx.ssd_cache.<qualified name> [tags]`` per member, then prose, then
(for code) a "Source code in vllm_mlx/ssd_cache.py" block holding that one
member's source, dedented.  What the seed leaves out - the module's imports,
the ``class`` statements, class attributes' placement - is reconstructed here:
headings with members below them are classes (their "Bases:" line gives the
bases, the ``dataclass`` tag the decorator, their own source block is
``__init__``); ``module-attribute`` and ``class-attribute`` entries
contribute their value line; a property documented without a source block
gets its body from the seed's "Direct return expressions:" fact.  A second,
per-callable listing later in the seed (headings with `` · ``) gives each
member's line range in the original file; it is used to order the members as
the original does and to check that no source block was cut short.

The assembled module runs against the project's stand-ins: ``mlx.core`` is
``mlx_standin``, ``safetensors.numpy`` is ``safetensors_np``, the
``.memory_cache`` names and ``mlx_lm.models.cache.KVCache`` come from
``mlx_standin``.  ``mlx_lm.models.cache.QuantizedKVCache`` stays unimportable,
as on a machine without mlx-lm, so the reference's duck-typed tuple test is
what recognises quantized layers.  Those names are resolved by an
``__import__`` private to the module's globals: nothing is added to
``sys.modules``, so other code importing ``mlx`` still finds no MLX.

Where the seed is missing, :class:`ReferenceUnavailable` says so; under
pytest the reason is raised as a skip tagged ``seed:`` (scripts/test.sh's
strict mode, as CI runs it, counts that tag as a failure).
"""

from __future__ import annotations

import builtins
import itertools
import os
import re
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))

#: Environment variable naming the shared directory (the one holding seed/
#: and upstream/); by default it is ``../shared`` beside the repository.
SHARED_ENV = "KVT_SHARED_DIR"
SEED_NAME = os.path.join("seed", "ssd_cache_reference.txt")
MODULE = "vllm_mlx.ssd_cache"
SOURCE_MARK = "Source code in vllm_mlx/ssd_cache.py"
LISTING_TITLE = "Complete contract reference"

# The seed documents neither the module's header nor its imports; these are
# the names its code uses at module level (exec_into() checks the list is
# complete for the seed at hand).
_PRELUDE = """\
from __future__ import annotations

import array as _array
import hashlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
"""


class ReferenceUnavailable(ImportError):
    """The seed is missing or cannot be assembled into a module."""


class SeedFormatError(ReferenceUnavailable):
    """The seed is present but does not read as this loader expects."""


def shared_dir() -> str:
    """The shared directory: $KVT_SHARED_DIR, else ``<repo>/../shared``."""
    env = os.environ.get(SHARED_ENV)
    if env:
        return os.path.abspath(env)
    return os.path.join(os.path.dirname(_REPO), "shared")


def seed_path() -> str:
    return os.path.join(shared_dir(), SEED_NAME)


def unavailable(reason: str):
    """Raise the reason the reference cannot be had: as a pytest skip tagged
    ``seed:`` when pytest is running (allowed at module level too, so a test
    module that needs the reference at import is skipped, not broken), else
    as ReferenceUnavailable."""
    msg = f"seed: {reason}"
    pytest = sys.modules.get("pytest")
    if pytest is not None:
        raise pytest.skip.Exception(msg, allow_module_level=True)
    raise ReferenceUnavailable(msg)


def require():
    """The reference module (``ssd_cache_ref``), or the reason it is missing
    raised through unavailable(): for code that needs the reference before
    it touches any of its names (a test that runs the tools as scripts)."""
    import ssd_cache_ref

    reason = ssd_cache_ref.__dict__.get("REFERENCE_MISSING")
    if reason:
        unavailable(reason)
    return ssd_cache_ref


#: Exit status of the tools (make_ref_cache.py, read_ref_cache.py) when the
#: reference cannot be loaded.
EXIT_UNAVAILABLE = 3


# ---------------------------------------------------------------- parsing

_HEADING = re.compile(r"^vllm_mlx\.ssd_cache(?:\.([A-Za-z_][\w.]*))?((?: [a-z][a-z-]*)*)$")
_LISTING = re.compile(r"^vllm_mlx\.ssd_cache\.([A-Za-z_][\w.]*) · ([a-z ]+)$")
_RANGE = re.compile(r"^View source #L(\d+)-L(\d+)\.$")
_RETURNS = re.compile(r"^• Direct return expressions: (.*)$")


class Member:
    """One documented member of the module (or of one of its classes)."""

    def __init__(self, name: str, tags: list[str]):
        self.name = name            # qualified below the module: "SSDIndex.touch"
        self.tags = tags            # "dataclass", "property", "module-attribute", ...
        self.text: list[str] = []   # the lines between this heading and the next
        self.source: list[str] | None = None
        self.first_line = 0         # in the original file, from the listing
        self.last_line = 0
        self.returns: str | None = None
        self.init_range = (0, 0)    # a class's __init__, whose source its heading holds
        self.text_line = 0          # seed line number of text[0]
        self.source_line = 0        # seed line number of source[0]

    @property
    def parent(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def short(self) -> str:
        return self.name.rpartition(".")[2]


def _split_source(lines: list[str]) -> tuple[list[str] | None, int]:
    """The code block that follows the source mark, blank lines around it
    dropped, and the index in ``lines`` of its first line."""
    try:
        at = lines.index(SOURCE_MARK) + 1
    except ValueError:
        return None, 0
    code = lines[at:]
    while code and not code[0].strip():
        code.pop(0)
        at += 1
    while code and not code[-1].strip():
        code.pop()
    return code, at


def parse_seed(text: str) -> list[Member]:
    """Members in the seed's order, each with its source block (or None) and
    the original line range where the listing gives one."""
    lines = text.splitlines()
    # The per-member part ends where the per-callable listing begins (its
    # title, or its first heading).
    split = next((i for i, ln in enumerate(lines)
                  if ln == LISTING_TITLE or _LISTING.match(ln)), len(lines))
    members: list[Member] = []
    by_name: dict[str, Member] = {}
    current: Member | None = None
    for no, ln in enumerate(lines[:split], 1):
        m = _HEADING.match(ln)
        if m and m.group(1):
            current = Member(m.group(1), m.group(2).split())
            current.text_line = no + 1
            members.append(current)
            by_name.setdefault(current.name, current)
            continue
        if m:  # the module's own heading
            current = None
            continue
        if current is not None:
            current.text.append(ln)
    for mem in members:
        mem.source, at = _split_source(mem.text)
        mem.source_line = mem.text_line + at

    listed: Member | None = None
    init = False
    for ln in lines[split:]:
        m = _LISTING.match(ln)
        if m:
            name = m.group(1)
            init = name.endswith(".__init__")
            listed = by_name.get(name[: -len(".__init__")] if init else name)
            continue
        if listed is None:
            continue
        r = _RANGE.match(ln)
        if r and init:
            listed.init_range = (int(r.group(1)), int(r.group(2)))
        elif r:
            listed.first_line, listed.last_line = int(r.group(1)), int(r.group(2))
        r = _RETURNS.match(ln)
        if r and not init and listed.returns is None:
            listed.returns = r.group(1)
    if not members:
        raise SeedFormatError("no member headings found")
    return members


# ------------------------------------------------------------- assembling

def _indent(lines: list[str], n: int) -> list[str]:
    pad = " " * n
    return [pad + ln if ln.strip() else "" for ln in lines]


def _value_line(mem: Member) -> str:
    """The assignment an attribute entry documents (its first text line)."""
    for ln in mem.text:
        if ln.strip():
            return ln.strip()
    raise SeedFormatError(f"{mem.name}: attribute without a value line")


def _bases(mem: Member) -> str:
    for ln in mem.text:
        if ln.startswith("Bases: "):
            return ln[len("Bases: "):].strip()
    return ""


def _check_block(name: str, code: list[str], span: tuple[int, int]) -> None:
    """A source block must span the line range the listing gives (when it
    gives one; the range starts at the ``def``, below any decorators): a
    shorter block means the seed was cut, a longer one that prose ran in."""
    first, last = span
    if first and last:
        want = last - first + 1
        got = len(code) - sum(1 for _ in itertools.takewhile(
            lambda ln: ln.startswith("@"), code))
        if got != want:
            raise SeedFormatError(
                f"{name}: source block has {got} lines below its decorators, "
                f"the listing says L{first}-L{last} ({want})")


def _property_from_facts(mem: Member) -> list[str]:
    """A property the seed documents without source: its annotation line
    (``name: type``) and its single return expression make the body."""
    expr = mem.returns
    if not expr or expr.endswith("…") or ";" in expr:
        raise SeedFormatError(f"{mem.name}: property without source or a whole "
                              "return expression")
    ann = _value_line(mem)
    rtype = ann.split(":", 1)[1].strip() if ":" in ann else ""
    arrow = f" -> {rtype}" if rtype else ""
    return ["@property", f"def {mem.short}(self){arrow}:", f"    return {expr}"]


def assemble(members: list[Member]) -> str:
    """Python source of the whole module from the parsed members."""
    names = {m.name for m in members}
    classes = {m.name for m in members
               if "." not in m.name and (any(n.startswith(m.name + ".") for n in names)
                                          or _bases(m) or "dataclass" in m.tags)}

    # Top-level pieces: (sort key, lines).  The key is the original line
    # number where the listing gives one; the others keep the seed's order
    # after what precedes them.
    pieces: list[tuple[tuple[int, int], list[str]]] = []
    last_key = 0
    for seq, mem in enumerate(members):
        if "." in mem.name:
            continue
        if mem.name in classes:
            body = _class_body(mem, [m for m in members if m.parent == mem.name])
            head = ["@dataclass"] if "dataclass" in mem.tags else []
            bases = _bases(mem)
            head.append(f"class {mem.short}({bases}):" if bases else f"class {mem.short}:")
            lines = head + body
        elif "module-attribute" in mem.tags:
            lines = [_value_line(mem)]
        elif mem.source is not None:
            _check_block(mem.name, mem.source, (mem.first_line, mem.last_line))
            lines = mem.source
        else:
            raise SeedFormatError(f"{mem.name}: neither class, attribute nor code")
        key = mem.first_line or last_key
        last_key = key
        pieces.append(((key, seq), lines))
    pieces.sort(key=lambda p: p[0])

    out = [f'"""{MODULE}, assembled from its API documentation by reference_loader."""', "",
           _PRELUDE]
    for _, lines in pieces:
        out.extend(lines)
        out.extend(["", ""])
    return "\n".join(out) + "\n"


def _class_body(cls: Member, children: list[Member]) -> list[str]:
    attrs: list[str] = []
    methods: list[tuple[int, list[str]]] = []  # (line in the original, code)
    if cls.source is not None:  # the class heading's block is its __init__
        _check_block(cls.name + ".__init__", cls.source, cls.init_range)
        methods.append((cls.init_range[0], cls.source))
    for mem in children:
        if "class-attribute" in mem.tags:
            attrs.append(_value_line(mem))  # in the seed's order: dataclass fields
        elif "instance-attribute" in mem.tags:
            continue  # assigned by __init__, which is in the source
        elif mem.source is not None:
            _check_block(mem.name, mem.source, (mem.first_line, mem.last_line))
            methods.append((mem.first_line, mem.source))
        elif "property" in mem.tags:
            methods.append((mem.first_line, _property_from_facts(mem)))
        else:
            raise SeedFormatError(f"{mem.name}: member without source")
    if all(line for line, _ in methods):
        methods.sort(key=lambda m: m[0])
    body: list[str] = []
    body.extend(_indent(attrs, 4))
    for _, m in methods:
        if body:
            body.append("")
        body.extend(_indent(m, 4))
    return body or ["    pass"]


# ---------------------------------------------------------------- running

def _standin_modules() -> dict[str, types.ModuleType]:
    """The modules the reference imports inside its functions, as stand-ins."""
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    import mlx_standin
    import safetensors_np

    def pkg(name: str, **children) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so dotted names below it resolve
        for k, v in children.items():
            setattr(mod, k, v)
        return mod

    lm_cache = types.ModuleType("mlx_lm.models.cache")
    lm_cache.KVCache = mlx_standin.KVCache  # QuantizedKVCache deliberately absent
    memory_cache = types.ModuleType("vllm_mlx.memory_cache")
    memory_cache._QuantizedCacheWrapper = mlx_standin._QuantizedCacheWrapper
    memory_cache._dequantize_cache = mlx_standin._dequantize_cache
    lm_models = pkg("mlx_lm.models", cache=lm_cache)
    return {
        "mlx": pkg("mlx", core=mlx_standin),
        "mlx.core": mlx_standin,
        "safetensors": pkg("safetensors", numpy=safetensors_np),
        "safetensors.numpy": safetensors_np,
        "mlx_lm": pkg("mlx_lm", models=lm_models),
        "mlx_lm.models": lm_models,
        "mlx_lm.models.cache": lm_cache,
        "vllm_mlx.memory_cache": memory_cache,
    }


def _private_builtins() -> dict:
    """builtins with an __import__ that maps the stand-in names (absolute,
    and the reference's one relative import from its package) and defers
    everything else to the real one."""
    table = _standin_modules()
    real_import = builtins.__import__

    def standin_import(name, globals=None, locals=None, fromlist=(), level=0):
        full = name
        if level == 1:
            full = "vllm_mlx." + name if name else "vllm_mlx"
        elif level:
            return real_import(name, globals, locals, fromlist, level)
        if full in table:
            if fromlist or level:
                return table[full]
            return table[full.split(".")[0]]
        if level == 0 and full.split(".")[0] in ("mlx", "mlx_lm", "safetensors", "vllm_mlx"):
            raise ModuleNotFoundError(f"No module named {full!r} (reference stand-ins)")
        if level:
            raise ModuleNotFoundError(f"No module named {full!r} (reference stand-ins)")
        return real_import(name, globals, locals, fromlist, level)

    ns = dict(builtins.__dict__)
    ns["__import__"] = standin_import
    return ns


def read_seed(path: str | None = None) -> str:
    path = path or seed_path()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ReferenceUnavailable(
            f"{path} not found (set {SHARED_ENV} to the directory holding "
            "seed/ssd_cache_reference.txt)") from None
    except OSError as e:
        raise ReferenceUnavailable(f"{path}: {e.strerror}") from None


def source(path: str | None = None) -> str:
    """The assembled module source; ReferenceUnavailable if there is none."""
    text = read_seed(path)
    try:
        return assemble(parse_seed(text))
    except SeedFormatError as e:
        raise SeedFormatError(f"{path or seed_path()}: {e}") from None


def exec_into(namespace: dict, path: str | None = None) -> None:
    """Run the assembled module in ``namespace`` (a module's __dict__)."""
    src = source(path)
    filename = f"<{MODULE} assembled from {path or seed_path()}>"
    namespace["__builtins__"] = _private_builtins()
    namespace["__reference_source__"] = src
    try:
        exec(compile(src, filename, "exec"), namespace)
    except Exception as e:  # a seed this loader does not understand
        raise SeedFormatError(f"{path or seed_path()}: the assembled module does not "
                              f"run: {type(e).__name__}: {e}") from e
    missing = undefined_globals(namespace)
    if missing:
        raise SeedFormatError(f"{path or seed_path()}: the assembled module uses "
                              f"names no import provides: {', '.join(missing)}")


def install(module: types.ModuleType, path: str | None = None) -> None:
    """Make ``module`` the reference: exec it into the module's namespace (so
    the reference's functions see what a test patches on the module), or, if
    the seed is missing or unreadable, leave the module importable with every
    attribute access other than dunders raising the reason through
    unavailable() - a skip under pytest."""
    before = set(module.__dict__)
    try:
        exec_into(module.__dict__, path)
    except ReferenceUnavailable as e:
        # Nothing half-built stays behind to be used by mistake.
        for name in set(module.__dict__) - before:
            del module.__dict__[name]
        reason = str(e)

        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            unavailable(reason)

        module.__getattr__ = __getattr__
        module.REFERENCE_MISSING = reason


def undefined_globals(namespace: dict) -> list[str]:
    """Global names the assembled functions load that neither the module
    nor builtins define: empty when the prelude's imports are complete."""
    import dis

    missing: set[str] = set()
    seen: set[int] = set()

    def walk(code):
        if id(code) in seen:
            return
        seen.add(id(code))
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                name = ins.argval
                if name not in namespace and not hasattr(builtins, name):
                    missing.add(name)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                walk(c)

    walk(compile(namespace["__reference_source__"], "<reference>", "exec"))
    return sorted(missing)
