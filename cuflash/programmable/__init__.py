"""Programmable attention: score_mod and mask_mod written in Python, read into one
expression tree (translate), evaluated on tiles with gradients (evaluate), and block
masks that say which tiles a mask leaves empty, partial or full (block_mask).
See docs/programmable.md."""
from .block_mask import BlockMask, block_mask
from .translate import Mod, translate

__all__ = ["BlockMask", "block_mask", "Mod", "translate"]
