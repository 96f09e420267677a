"""An eager decode step's host cost (README.md). `VARIANTS`: the named sets of decode switches
(`sparseflash.flash.decode.OVERRIDES`) its tools and the decode bench's ``sparseflash-NAME`` providers
measure beside the default. Since the H200 measurement of fdc55a7 the default checks a read's bounds in the
split kernel and balances the split count (`decode.SWITCH_DEFAULTS`); the previous default, and each of
those two alone turned off, stay measurable: ``old`` (both off: fdc55a7's default), ``unbalanced`` (the
split count of about two waves), ``host-check`` (the bounds checked by their own launch); ``fused`` turns
the study switch ``fused_combine`` on over the default."""

VARIANTS = {"default": {}, "old": dict(balanced_splits=False, check_in_split=False),
            "unbalanced": dict(balanced_splits=False), "host-check": dict(check_in_split=False),
            "fused": dict(fused_combine=True)}
