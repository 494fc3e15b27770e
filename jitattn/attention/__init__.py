"""Python front-ends of the attention kernels (wrappers and functions)."""
