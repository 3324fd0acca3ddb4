"""The offline side: reads run directories and bundles (``gradnan.formats``) and answers from them:
``report``, ``frames_view``, ``plot``, ``replay``. It never imports the training side or Megatron."""
