"""``gradnan replay BUNDLE``: rerun a captured module call offline, judge whether the failure reproduces,
and compare replays under other stacks (``--against``). The modules, in reading order:

- ``command``: the replay of one bundle in three precisions and its verdict (``replay_bundle``);
- ``text``: that verdict as people read it (``format_text``), and the phrases the comparison shares;
- ``trace``: the op-by-op replay of a recorded trace without the module's code (``replay``);
- ``checks``: what the replay checks before an operator runs, so that a crafted trace cannot make a
  kernel read or write outside its tensors;
- ``references``: reference math for the fused kernels the kit knows (kernel bug or numerics);
- ``limits``: the limits of one replay child process (no torch import: the command line parses fast);
- ``isolation``: the replay in a child process under those limits (``replay_isolated``), or under another
  interpreter (``replay_under``);
- ``child``: that other interpreter's child process (``python -m gradnan.offline.replay.child``);
- ``comparison``: one bundle's replays under other stacks compared op by op (``compare``).

Nothing is imported here: ``gradnan.offline.replay.limits`` is read by the command line without torch.
"""
