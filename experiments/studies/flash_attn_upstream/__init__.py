"""flash-attn conformance runners: the project's own port (conformance.py) and a cross-check that
runs flash-attn's upstream tests/test_flash_attn.py, from an uncommitted copy in .upstream/, against
sparseflash through a ``flash_attn`` name shim (run_upstream.py)."""
