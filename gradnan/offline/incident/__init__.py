"""One run directory's incident, in the order the data flows (one way, no returns):

1. ``read``: every file checked once at the boundary (``RunFiles``; a bad line is a listed problem);
   ``runs``: the launches and their first failing steps; ``world``: each launch's job (its world size) and
   the records from inside it.
2. ``gradients``, ``rerun_finding``, ``runup``: the failing step's records as typed views (the
   gradients rank by rank and their pattern, what the rerun's replicas concluded, the run-up).
3. ``evidence`` (with ``conflicts``: what the step's records contradict): the typed
   ``decision.evidence.Evidence`` from them; ``gradnan.decision`` decides; ``evidence_lines`` words what
   the decision rests on.
4. ``analysis``: ``analyze()`` assembles the typed ``verdict.Report`` from the decision.
5. Renderers: ``report`` (text and ``--json``; its table of modules by rank: ``module_table``), ``plot``
   (``plot_grid``, ``plot_evidence``, ``plot_blocks``), ``frames_view`` and ``batch_view``.
"""
