"""Every environment variable sparseflash reads, in one place. Each switch is read here; the module
that acts on it keeps its value as a module attribute, so a program (or a test) may also set that
attribute directly. Values read at import are marked so; the others on every use.

| variable | values | read by | meaning |
|---|---|---|---|
| ``TRITON_INTERPRET`` | 0 / 1 | `interpreting()` (on use); `kernels.INTERPRET`, `tiles.INTERPRETING` (import) | the Triton interpreter runs the kernels on CPU tensors |
| ``SPARSEFLASH_HOPPER`` | auto / off | `flash.hopper.forward.MODE` | off: the portable kernels everywhere |
| ``SPARSEFLASH_HOPPER_DYNAMIC`` | off / auto / all | `flash.hopper.forward.DYNAMIC` | the Hopper forward's dynamic tile schedule: never / causal calls with short walks, in head sections / every call |
| ``SPARSEFLASH_HOPPER_BWD`` | auto / on / off | `flash.hopper.backward.MODE` | the one-pass Hopper backward: by its dispatch rule / always / never |
| ``SPARSEFLASH_HOPPER_EXACT`` | on / off | `flash.dispatch.HOPPER_EXACT` | calls with exact-mask bits may take the Hopper kernels |
| ``SPARSEFLASH_TMA`` | auto / on / off | `flash.tiles.TMA_MODE` | TMA descriptor loads on sm_90+ |
| ``SPARSEFLASH_FAST_PATH`` | 1 / 0 | `flash.fast.ENABLED` | the short path of repeated eager calls |
| ``SPARSEFLASH_FAST_LAUNCH`` | 1 / 0 | `flash.binding.FAST_LAUNCH` | bound launches (0: Triton's own launch path, for A/B timing) |
| ``SPARSEFLASH_NATIVE`` | 1 / 0 | `flash.native.ENABLED` | the C++ half of the short path |
| ``SPARSEFLASH_NATIVE_CXXFLAGS``, ``CXX`` | flags, a compiler | `flash.native` (on use) | how the C++ half is built |
| ``SPARSEFLASH_CACHE`` | a folder | `flash.native.cache_dir` (on use) | where it is built (default ``~/.cache/sparseflash``) |
| ``SPARSEFLASH_GATHER_MAX`` | an int | `flash.operands.GATHER_MAX` | the longest block list the kernels gather at once |
| ``SPARSEFLASH_CHECK_KEY_LENGTHS`` | 1 / 0 | `api.CHECK_KEY_LENGTHS` | check key_lengths' range (a host synchronisation); `flash_attn_with_kvcache`: a paged cache's capacity on the host (0: on the device) |
| ``SPARSEFLASH_KVCACHE_HOST_CHECKS`` | 0 / 1 | `kvcache.HOST_CHECKS` | debug: `flash_attn_with_kvcache` reads cache_seqlens (leftpad, batch index, page ids) back and names a bad value (a host synchronisation; 0: checked on the device) |
| ``SPARSEFLASH_DEBUG`` | 0 / 1 | `debug()` (on use) | commands re-raise errors with their traceback |
"""

from __future__ import annotations

import os

__all__ = ["flag", "text", "interpreting", "debug"]


def text(name: str, default: str = "") -> str:
    """The variable's value, ``default`` when unset."""
    return os.environ.get(name, default)


def flag(name: str, default: bool) -> bool:
    """A 0/1 switch: unset gives ``default``; "" and "0" are off, anything else on."""
    value = os.environ.get(name)
    return default if value is None else value not in ("", "0")


def interpreting() -> bool:
    """TRITON_INTERPRET is on now (Triton reads it when it compiles a kernel)."""
    return flag("TRITON_INTERPRET", False)


def debug() -> bool:
    """SPARSEFLASH_DEBUG is on now."""
    return flag("SPARSEFLASH_DEBUG", False)
