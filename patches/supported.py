"""The megatron-core releases gradnan's patches were run against, declared once (as OpenTelemetry's
instrumentations declare theirs in ``package.py``). Read by every instrumentor's run-time check
(``Instrumentor.supported``), by the packaging (``setup.py``: ``install_requires`` takes its floor and no
ceiling, so that pip never downgrades or refuses a newer megatron-core) and held against the docs by
tests/test_packaging.py. A plain assignment, imported by nothing here: ``setup.py`` reads it as text
before anything is installed.

The upper bound is one past the newest release run here (docs/megatron-versions.md says which, where
and when)."""

MEGATRON_CORE = ">=0.12,<0.21"
