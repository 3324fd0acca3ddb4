"""The training-time side: ``install()`` patches Megatron through the patch layer (``gradnan.patches``, the
top-level ``patches/`` folder: the only code that imports Megatron), the runtime turns its calls into
findings with pure functions over tensors, and the writer puts them on disk in the formats of
``gradnan.formats``. Nothing here reads those files back."""
