"""The one contract between the training-time side and the offline side: the files on disk.

One module per document kind, each with its own ``Schema`` (name and version), a ``to_json`` builder
where the training side writes it and the strict ``from_json`` / ``load`` every reader uses:
``maps``, ``records``, ``bundle`` (with ``trace``, the op trace inside it) and ``selftest``;
``layout`` says where each file goes, ``schema`` what all documents share. docs/formats.md documents
every field.
"""
