"""``gradnan selftest``: is the GPU behind a NaN bad? Launched like training, on every rank.

Silent data corruption shows up as arithmetic that differs from the other GPUs on the same input. Every
rank checks that it can reach the others (``communication``), then runs the same seeded workload and
compares the hashes of its results bitwise with every other rank's (``arithmetic``). The majority value
of each check is taken as right; rank 0 names every rank that disagrees or cannot be reached, prints PASS
or FAIL (``render``) and writes the ``gradnan.selftest`` result (``result``). ``runner`` runs one rank,
every wait bounded by the timeout; ``options`` is what it is told, ``command`` the command line.
Docs: docs/selftest.md.

Importing this package does not import torch (the command line builds its parser from it): only
``communication``, ``arithmetic`` and ``runner`` do, and ``run`` loads them.
"""

from .command import add_arguments, run

__all__ = ["add_arguments", "run"]
