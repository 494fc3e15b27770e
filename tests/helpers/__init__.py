"""Helpers shared by the cache tests (child-process runner, a compiler wrapper)."""
