"""JSON files: the one validating loader and the one atomic writer attnreg uses.

Every JSON file attnreg reads (cost profiles, conformance reports given to
``--merge``) goes through :func:`read_json` and a :class:`Schema`; every one
it writes (``-o FILE``, profiles, reports) through :func:`write_json`.  So a
file that is too large, not UTF-8, not JSON, nested too deep, holds a number
no float can hold, or has a value of the wrong type or range ends in one
error of the caller's documented type (``CostProfileError``,
``ReportError``, ...), naming the file and the first problem, never in a
``UnicodeDecodeError``, ``RecursionError`` or ``OverflowError``.

Why hand-written (docs/decisions.md, "One validating JSON loader"): the
schemas are small, and the validation libraries measured here cost more
start-up time than ``attnreg compat`` (which reads the shipped profiles on
every run) has left under its P5 goal.  Pure stdlib; no torch.

Examples
--------
>>> schema = Obj({"name": Str(), "size": Num(minimum=0)})
>>> schema.first_problem({"name": "a", "size": -1})
'at `size`: -1 is below the minimum 0'
>>> schema.first_problem({"name": "a", "size": 2}) is None
True
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import AttnregError

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "AnyValue",
    "Bool",
    "Check",
    "Int",
    "JSONFileError",
    "List",
    "Map",
    "Nullable",
    "Num",
    "Obj",
    "Schema",
    "Str",
    "newer_schema_problem",
    "parse_json",
    "problems_text",
    "read_json",
    "write_json",
]

#: Files larger than this are refused before they are read (the largest shipped
#: profile is about 75 kB; a conformance report of every claim about 1 MB).
MAX_FILE_BYTES = 64 * 1024 * 1024
#: Objects and lists nested deeper than this are refused (attnreg's files nest 6 deep).
MAX_DEPTH = 64

#: What a caller's documented error is built from: (file name, problem) -> exception.
ErrorFactory = Callable[[str, str], Exception]


class JSONFileError(AttnregError, ValueError):
    """A JSON file attnreg cannot read or write, for callers without an error of their own
    (``-o FILE`` of every command): ``FILE: problem; what to do``."""

    def __init__(self, source: str, problem: str) -> None:
        self.source = source
        self.problem = problem
        super().__init__(f"{source}: {problem}; check the path (a file you may write, in a "
                         "directory that exists or can be made)")


# ----------------------------------------------------------------------------------------
# schemas: small declarative checks, the first problem with its JSON path
# ----------------------------------------------------------------------------------------

def _show(value: Any) -> str:
    """``value`` for a message, cut short (a 20,000-digit number stays one line)."""
    if isinstance(value, int) and value.bit_length() > 200:  # str() of 5,000 digits raises
        return f"a number of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "a number", float: "a number"}.get(type(value),
                                                                         type(value).__name__)


class Schema:
    """A check of one JSON value; :meth:`first_problem` says what is wrong, or None.

    Subclasses implement :meth:`problem` (the first problem of ``value`` at
    ``path``); :class:`Obj` goes on to its next key after a problem, so
    :meth:`problems` can list the first few at once.  Plain classes, not
    dataclasses: this module is imported on every ``attnreg compat`` (P5), and a
    dataclass costs its generated methods at import.
    """

    def problem(self, value: Any, path: str) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def problems(self, value: Any, path: str = "") -> Iterator[str]:
        """Every problem, lazily (one per object key at most)."""
        found = self.problem(value, path)
        if found:
            yield found

    def first_problem(self, value: Any) -> str | None:
        """The first problem found in ``value`` (``at `a.b`: ...``), or None."""
        return next(iter(self.problems(value)), None)


def _at(path: str, message: str) -> str:
    return f"at `{path}`: {message}" if path else message


class AnyValue(Schema):
    """Any JSON value (kept, not interpreted)."""

    def problem(self, value: Any, path: str) -> str | None:
        return None


class Str(Schema):
    """A string; ``choices``: one of these; ``nonempty``: not ``""``."""

    def __init__(self, choices: tuple[str, ...] = (), nonempty: bool = False) -> None:
        self.choices = choices
        self.nonempty = nonempty

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str):
            return _at(path, f"expected a string, got {_kind(value)} ({_show(value)})")
        if self.nonempty and not value:
            return _at(path, "expected a non-empty string")
        if self.choices and value not in self.choices:
            return _at(path, f"{_show(value)} is not one of {', '.join(self.choices)}")
        return None


class Bool(Schema):
    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, bool):
            return _at(path, f"expected true or false, got {_kind(value)} ({_show(value)})")
        return None


class Num(Schema):
    """A finite number (a JSON int or float that a float holds) within the bounds."""

    def __init__(self, minimum: float | None = None, maximum: float | None = None) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def problem(self, value: Any, path: str) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _at(path, f"expected a number, got {_kind(value)} ({_show(value)})")
        try:
            as_float = float(value)
        except OverflowError:  # an int like 10**400: no float holds it
            as_float = math.inf
        if not math.isfinite(as_float):
            return _at(path, f"{_show(value)} is not a finite number a float can hold")
        if self.minimum is not None and as_float < self.minimum:
            return _at(path, f"{_show(value)} is below the minimum {self.minimum:g}")
        if self.maximum is not None and as_float > self.maximum:
            return _at(path, f"{_show(value)} is above the maximum {self.maximum:g}")
        return None


class Int(Schema):
    """A whole number within the bounds (``true`` is not 1 here)."""

    def __init__(self, minimum: int | None = None, maximum: int | None = None) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def problem(self, value: Any, path: str) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return _at(path, f"expected a whole number, got {_kind(value)} ({_show(value)})")
        if self.minimum is not None and value < self.minimum:
            return _at(path, f"{_show(value)} is below the minimum {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            return _at(path, f"{_show(value)} is above the maximum {self.maximum}")
        return None


class Nullable(Schema):
    """``null`` or what ``inner`` accepts."""

    def __init__(self, inner: Schema) -> None:
        self.inner = inner

    def problem(self, value: Any, path: str) -> str | None:
        return None if value is None else self.inner.problem(value, path)


class List(Schema):
    """A list whose items ``item`` accepts."""

    def __init__(self, item: Schema | None = None) -> None:
        self.item = item or AnyValue()

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, list):
            return _at(path, f"expected a list, got {_kind(value)} ({_show(value)})")
        for i, v in enumerate(value):
            found = self.item.problem(v, f"{path}[{i}]")
            if found:
                return found
        return None


class Map(Schema):
    """An object of any keys (``keys``: only these; ``nonempty``) whose values ``value`` accepts."""

    def __init__(self, value: Schema | None = None, keys: tuple[str, ...] = (),
                 nonempty: bool = False) -> None:
        self.value = value or AnyValue()
        self.keys = keys
        self.nonempty = nonempty

    def problem(self, value: Any, path: str) -> str | None:
        if not isinstance(value, Mapping):
            return _at(path, f"expected an object, got {_kind(value)} ({_show(value)})")
        if self.nonempty and not value:
            return _at(path, "expected a non-empty object")
        for k, v in value.items():
            if self.keys and k not in self.keys:
                return _at(path, f"unknown key {_show(k)} (known: {', '.join(self.keys)})")
            found = self.value.problem(v, f"{path}.{k}" if path else str(k))
            if found:
                return found
        return None


class Obj(Schema):
    """An object with these keys (each required unless in ``optional``); others are kept."""

    def __init__(self, fields: Mapping[str, Schema], optional: tuple[str, ...] = ()) -> None:
        self.fields = fields
        self.optional = optional

    def problem(self, value: Any, path: str) -> str | None:
        return next(iter(self.problems(value, path)), None)

    def problems(self, value: Any, path: str = "") -> Iterator[str]:
        if not isinstance(value, Mapping):
            yield _at(path, f"expected an object, got {_kind(value)} ({_show(value)})")
            return
        for name, schema in self.fields.items():
            where = f"{path}.{name}" if path else name
            if name not in value:
                if name not in self.optional:
                    yield _at(where, "missing")
                continue
            found = schema.problem(value[name], where)
            if found:
                yield found


class Check(Schema):
    """What ``inner`` accepts, then ``test(value)``: None, or the problem."""

    def __init__(self, inner: Schema, test: Callable[[Any], str | None]) -> None:
        self.inner = inner
        self.test = test

    def problem(self, value: Any, path: str) -> str | None:
        found = self.inner.problem(value, path)
        if found:
            return found
        message = self.test(value)
        return _at(path, message) if message else None


# ----------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------

def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth_problem(data: Any, limit: int) -> str | None:
    """Whether ``data`` nests deeper than ``limit`` (iterative: no recursion to run out of)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return f"nested deeper than {limit} levels"
            children = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in children)
    return None


def parse_json(raw: bytes | str, source: str, error: ErrorFactory, *,
               schema: Schema | None = None, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` parsed and checked; any problem is ``error(source, problem)``.

    Refused: bytes that are not UTF-8, text that is not JSON (``NaN`` and
    ``Infinity`` included), nesting deeper than ``max_depth``, numbers with
    more digits than Python converts, and whatever ``schema`` refuses.
    """
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(source, f"is not UTF-8 text (byte {exc.start}: {exc.reason})") \
                from None
    else:
        text = raw
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise error(source, f"is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                            f"{exc.colno})") from None
    except RecursionError:
        raise error(source, f"is not valid JSON here: nested deeper than {max_depth} "
                            "levels") from None
    except ValueError as exc:  # NaN/Infinity, or an int past Python's digit limit
        raise error(source, f"is not valid JSON here ({exc})") from None
    problem = _depth_problem(data, max_depth)
    if problem is None and schema is not None:
        problem = problems_text(schema, data)
    if problem:
        raise error(source, problem)
    return data


#: How many problems one message lists (the first ones found).
MAX_PROBLEMS = 3


def newer_schema_problem(data: Any, newest: int) -> str | None:
    """Why ``data`` (a parsed document) cannot be read when its ``schema_version`` is a
    number above ``newest``, the last version this attnreg reads; else None (a missing or
    malformed version is the schema's to report)."""
    version = data.get("schema_version") if isinstance(data, Mapping) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        return f"schema_version {_show(version)} is newer than this attnreg reads ({newest})"
    return None


def problems_text(schema: Schema, data: Any) -> str | None:
    """The first :data:`MAX_PROBLEMS` problems of ``data``, ``"; "``-joined, or None."""
    found = list(itertools.islice(schema.problems(data), MAX_PROBLEMS))
    return "; ".join(found) or None


def read_json(path: str | os.PathLike[str], error: ErrorFactory = JSONFileError, *,
              schema: Schema | None = None, max_bytes: int = MAX_FILE_BYTES,
              max_depth: int = MAX_DEPTH) -> Any:
    """The JSON document in ``path``, checked by ``schema``.

    Raises
    ------
    Exception
        ``error(str(path), problem)`` for every problem: missing, a directory,
        unreadable, larger than ``max_bytes``, or refused by :func:`parse_json`.
    """
    source = str(path)
    try:
        with open(path, "rb") as f:
            if stat.S_ISDIR(os.fstat(f.fileno()).st_mode):  # pragma: no cover - open fails
                raise IsADirectoryError(21, "Is a directory")
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(source, "no such file") from None
    except IsADirectoryError:
        raise error(source, "is a directory, not a JSON file") from None
    except OSError as exc:
        raise error(source, f"cannot be read ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:
        limit = f"{max_bytes / 2**20:g} MiB" if max_bytes >= 2**20 else f"{max_bytes} bytes"
        raise error(source, f"is larger than {limit}, more than any file attnreg writes")
    return parse_json(raw, source, error, schema=schema, max_depth=max_depth)


# ----------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------

def write_json(path: str | os.PathLike[str], data: Any, error: ErrorFactory = JSONFileError, *,
               what: str = "the JSON") -> Path:
    """Write ``data`` as indented JSON to ``path`` without ever leaving half a file.

    A regular file (or a new one) is written to a temporary file beside it
    and renamed over it, so a failed write (disk full, interrupted) leaves
    what was there.  A path that exists but is not a regular file
    (``/dev/stdout``, a named pipe) is written directly.  Missing parent
    directories are created.  Every failure is ``error(str(path), problem)``.
    """
    p = Path(path)
    text = json.dumps(data, indent=2) + "\n"
    source = str(p)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise error(source, f"cannot write {what} there ({exc.strerror or exc})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise error(source, f"is a directory, not a file to write {what} to")
    try:
        if st is not None and not stat.S_ISREG(st.st_mode):
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
            return p
        if p.parent != Path(""):
            p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if st is not None:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
            else:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != source else ""
        raise error(source, f"cannot write {what} there: {exc.strerror or exc}{where}") \
            from None
    return p

