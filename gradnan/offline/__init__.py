"""The offline side, one package per product; each reads run directories or bundles (``gradnan.formats``)
and never imports the training side or Megatron:

- ``incident``: a run directory's incident, decided by ``gradnan.decision`` and rendered (``gradnan
  report``, ``--json``, ``--plot``), with ``gradnan frames`` and ``gradnan batch``;
- ``replay``: a captured bundle replayed op by op (``gradnan replay``, ``--against``).
"""
