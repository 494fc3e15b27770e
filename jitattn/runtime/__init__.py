"""The runtime under the public ops: per-call checks, plans, workspaces and launches.

A wrapper in ``jitattn.ops`` turns its arguments into a spec (``specs``), checks them (``checks``,
``options``), plans the work (``batch``, ``page``, ``mla_kernel``) and launches the loaded kernel
(``launch``, ``compiled``). Nothing here imports ``jitattn.ops``.
"""
