"""Kernel-error translation: a library's pre-launch ``ValueError`` becomes ``UnsupportedError``."""

from __future__ import annotations

from attnreg.registry import UnsupportedError

__all__ = ["KERNEL_ERRORS_HINT", "KernelErrors"]

#: The hint of a translated kernel refusal.
KERNEL_ERRORS_HINT = ("the kernel refused the inputs before launching; fix them or check "
                      "`attnreg backends --json` for what this backend declares")


class KernelErrors:
    """``with`` block that turns a library's pre-launch ``ValueError`` into
    :class:`UnsupportedError` (an UnsupportedError passes through unchanged).

    A plain class rather than ``contextlib.contextmanager``: it wraps every
    kernel launch, and a generator-based context manager costs a generator
    and two extra frames per launch.
    """

    __slots__ = ("backend", "what", "hint")

    def __init__(self, backend: str, what: str, hint: str = KERNEL_ERRORS_HINT) -> None:
        self.backend, self.what, self.hint = backend, what, hint

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        # Returning None never swallows: anything but a library ValueError propagates.
        if isinstance(exc, ValueError) and not isinstance(exc, UnsupportedError):
            raise UnsupportedError(self.backend, self.what, str(exc), self.hint) from exc
