"""Errors raised by the render/build/cache/load pipeline."""

from __future__ import annotations


class JitError(RuntimeError):
    """Base class of jitattn's pipeline errors."""


class BuildError(JitError):
    """The compiler failed; the message carries its output and the rendered source's path."""


class CacheError(JitError):
    """The cache cannot be used as configured (permissions, space, unsafe layer)."""


class CompileDisabledError(JitError):
    """A compile was needed while JITATTN_ASSERT_NO_COMPILE=1."""


class KernelError(JitError):
    """A launch returned an error code; the message is the kernel's own."""
