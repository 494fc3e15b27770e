"""Adapters that plug jitattn into other libraries (each imports its library only when imported itself)."""
