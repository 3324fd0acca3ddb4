"""The harness: a tiny real Megatron-Core GPT on CPU (``toy``), the CUDA-to-CPU shim it runs through
(``cpu_shim``), measuring tools (``measure``) and the demo. Used by the demo, the tests and the
benchmarks; never by ``install()``."""
