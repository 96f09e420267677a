"""LRA and Path-X data: generators that write the release layout, and loaders that read it.

- `get_dataset(task, root, split, cache_dir=None, **options)`: every LRA task (datasets.py).
- `listops`: the ListOps generator (``sparseflash lra data listops``), parser and evaluator.
- `pathfinder`: the Pathfinder / Path-X / Path-256 generator (``sparseflash lra data pathfinder``).
- `show`: pictures of generated data (``sparseflash lra show listops|pathfinder``).

The loaders (and torch) are imported on first use, so the generators' worker processes stay light.
"""

TASKS = ("listops", "text", "text4k", "retrieval", "image", "pathfinder32", "pathfinder64", "pathx", "path256")
SPLITS = ("train", "val", "test")

__all__ = ["TASKS", "SPLITS", "get_dataset", "LRADataset", "DatasetNotFoundError", "MalformedDataError",
           "pathfinder_split"]


def __getattr__(name):
    if name in ("get_dataset", "LRADataset", "DatasetNotFoundError", "MalformedDataError", "PATHFINDER_BLACKLIST",
                "pathfinder_split"):
        from sparseflash.experiments.lra.data import datasets

        return getattr(datasets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
