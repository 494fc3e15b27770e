"""Find the template tree in a source checkout or an installed wheel."""

from __future__ import annotations

import functools
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


@functools.cache
def template_root() -> Path:
    """``jitattn/templates`` inside a wheel, else the checkout's top-level ``templates/``."""
    for candidate in (_PACKAGE_DIR / "templates", _PACKAGE_DIR.parent / "templates"):
        if (candidate / "cpu").is_dir() and (candidate / "cuda").is_dir():
            return candidate
    raise FileNotFoundError(
        f"jitattn templates not found next to {_PACKAGE_DIR}; the installation is incomplete: "
        "reinstall jitattn (pip install --force-reinstall jitattn) or run from a full source checkout"
    )


def include_dir(target: str) -> Path:
    """Hand-written headers of one target, passed to the compiler with -I."""
    return template_root() / target / "include"
