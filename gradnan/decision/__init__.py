"""Every decision gradnan makes, as declared rule tables over typed observations (pure: no torch, no
files). The training side records what it saw; this package decides from it, and both the rank's log line
and the offline report call the same functions, so they cannot disagree.

Read in this order:

- ``facts``: the facts a rule may need (``Fact``), and how to get one that was not observed.
- ``replica``: what one data-parallel replica's rerun of the failing step observed, and its conclusion
  (``REPLICA_RULES``), and which replica's conclusion speaks for the job (``PRECEDENCE``).
- ``origin``: which ranks the gradients' records point at, and what that rests on (``ORIGIN_RULES``).
- ``causes``: the typed ``Evidence`` and the cause table (``RULES``): cause, origin, culprit, wording and
  next actions of each rule, and the ``Decision``.
- ``actions``: the next actions a rule lists, each a small function of the evidence.
"""
