"""The one enum base of attnreg: str-valued, printed as its value, parsed leniently.

Values appear in JSON, tables, claim ids and CLI flags, so ``str(member)`` is
the value (not ``Class.NAME``) and :meth:`StrEnum.parse` accepts either the
value or the name, in any case, with ``-`` for ``_``.  (Python 3.11 has
``enum.StrEnum``; attnreg supports 3.10, and wants ``parse`` too.)
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["StrEnum"]

_E = TypeVar("_E", bound="StrEnum")


class StrEnum(str, enum.Enum):
    """str-valued enum whose str() is its value (stable in JSON and tables)."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def parse(cls: type[_E], text: str | StrEnum) -> _E:
        """Parse a value case-insensitively (``"tc_piecewise"``, ``"TC-PIECEWISE"``)."""
        if isinstance(text, cls):
            return text
        key = str(text).strip().lower().replace("-", "_")
        for member in cls:
            if member.value == key or member.name.lower() == key:
                return member
        allowed = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown {cls.__name__} {text!r}; expected one of: {allowed}")
