"""An eager decode step's host cost (README.md). `VARIANTS`: the named sets of decode study switches
(`sparseflash.flash.decode.OVERRIDES`) its tools and the decode bench's ``sparseflash-NAME`` providers
measure beside the default."""

VARIANTS = {"default": {}, "fused": dict(fused_combine=True), "check": dict(check_in_split=True),
            "both": dict(fused_combine=True, check_in_split=True), "balanced": dict(balanced_splits=True)}
