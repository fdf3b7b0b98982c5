"""Interface of the C module built from ``engine_ext/vllm/_block_speedups.c``."""

from typing import Any

class BlockFields:
    """ElasticBlockPool's per-block loops for blocks of exactly one (slotted) class."""

    cls: type
    def __init__(self, cls: type) -> None: ...
    def take(self, all_blocks: list[Any], ids: list[int]) -> list[Any]:
        """``[all_blocks[i] for i in ids]``, each checked free (ref_cnt 0, no hash), ref_cnt 1."""
    def split_freed(
        self, blocks: Any, pool: object
    ) -> tuple[list[int], list[Any], list[int], list[Any]] | list[Any]:
        """One reference off each block: (ids to free, blocks to cache, their ids, other
        pools' blocks); or, with a block of another class, the blocks as a list, unchanged."""
