"""The package version (one place; the package face and the cache manifest read it)."""

__version__ = "0.1.0"
