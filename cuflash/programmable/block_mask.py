"""Block masks: which (query block, key block) tiles a mask_mod leaves empty, partial or full.

`block_mask` evaluates the mask_mod once over the whole (B, H, Nq, Nk) grid and keeps one
byte per tile: on the GPU (or in the emulator) one thread block per tile
(kernels/block_mask.cu, the mask_mod compiled in as the attention kernels compile it), on
the host one strip of query blocks at a time (memory O(B·H·block·Nk) at most, never
N×N). Attention with a block mask skips empty tiles, evaluates the mask_mod only in
partial tiles and runs full tiles as plain attention; the tiles are the block mask's own
blocks. A block mask serves any call with the same mask_mod, B, H, Nq and Nk (layers,
steps), and `save` / `BlockMask.load` keep it across processes.
"""
import numpy as np

from .. import _dispatch
from .evaluate import Bound
from .ir import FLOAT
from .translate import Mod, translate

EMPTY, PARTIAL, FULL = 0, 1, 2
_STRIP = 1 << 24  # mask values evaluated at once (16 MB of bools)


class BlockMask:
    """kinds[b, h, i, j] ∈ {EMPTY, PARTIAL, FULL} for query block i (rows i·block_q …)
    and key block j of batch row b and query head h (axes of size 1 broadcast: the mask
    does not depend on them). `mod` is the translated mask_mod the partial tiles run."""

    def __init__(self, mod, kinds, block, Nq, Nk, dtype):
        self.mod, self.kinds, self.block = mod, kinds, tuple(block)
        self.Nq, self.Nk, self.dtype = Nq, Nk, np.dtype(dtype)
        self._tiles = {}  # (rows, keys, xp) -> kernel_tiles' array

    def kernel_tiles(self, rows, keys, xp=np):
        """The kinds of a kernel's tiles of `rows` queries × `keys` keys (B or 1, H or 1,
        ⌈Nq/rows⌉, ⌈Nk/keys⌉), C-contiguous uint8 on the array module xp: a tile is empty
        if every block it overlaps is, full if every one is, else partial. Kept per tile
        shape: a kernel launch looks up one byte per tile."""
        key = (rows, keys, xp.__name__)
        if key not in self._tiles:
            k = self.kinds
            for axis, tile, block, n in ((2, rows, self.block[0], self.Nq),
                                         (3, keys, self.block[1], self.Nk)):
                starts = np.arange(0, n, tile)
                first, last = starts // block, (np.minimum(starts + tile, n) - 1) // block
                size = (last - first + 1).reshape([-1 if a == axis else 1 for a in range(4)])

                def count(kind):  # blocks of `kind` in each tile's span [first, last]
                    c = np.cumsum(k == kind, axis=axis)
                    c = np.concatenate([np.zeros_like(np.take(c, [0], axis)), c], axis)
                    return np.take(c, last + 1, axis) - np.take(c, first, axis)

                k = np.where(count(EMPTY) == size, EMPTY,
                             np.where(count(FULL) == size, FULL, PARTIAL)).astype(np.uint8)
            self._tiles[key] = xp.ascontiguousarray(xp.asarray(k))
        return self._tiles[key]

    @property
    def shape(self):
        """(B or 1, H or 1, Nq, Nk): the attention calls this block mask serves."""
        return self.kinds.shape[:2] + (self.Nq, self.Nk)

    def sparsity(self):
        """The fraction of tiles that are empty (skipped), over the whole mask."""
        return float(np.mean(self.kinds == EMPTY))

    def __repr__(self):
        counts = np.bincount(self.kinds.ravel(), minlength=3)
        return (f"BlockMask({self.mod.name}, shape={self.shape}, block={self.block}: "
                f"{counts[EMPTY]} empty, {counts[PARTIAL]} partial, {counts[FULL]} full tiles)")

    def save(self, path):
        """Write the block mask to `path` (.npz); BlockMask.load(path, mask_mod) reads it."""
        np.savez(path, kinds=self.kinds, block=np.array(self.block), sizes=np.array(
            [self.Nq, self.Nk]), key=np.array(self.mod.key()), dtype=np.array(self.dtype.str))

    @classmethod
    def load(cls, path, mask_mod):
        """The block mask saved at `path`, for the same mask_mod (checked by its translation)."""
        mod = mask_mod if isinstance(mask_mod, Mod) else translate(mask_mod, "mask_mod")
        with np.load(path) as f:
            if str(f["key"]) != mod.key():
                raise ValueError(f"the block mask in {path} was made for another mask_mod "
                                 f"than {mod.name}")
            Nq, Nk = (int(x) for x in f["sizes"])
            return cls(mod, f["kinds"], tuple(int(x) for x in f["block"]), Nq, Nk,
                       str(f["dtype"]))

    def check(self, B, Hq, Nq, Nk, acc_t):
        """ValueError unless this block mask serves attention of these sizes."""
        Bm, Hm = self.kinds.shape[:2]
        if (Nq, Nk) != (self.Nq, self.Nk) or Bm not in (1, B) or Hm not in (1, Hq):
            raise ValueError(f"block_mask was made for (B, H, Nq, Nk) = {self.shape} (1: any); "
                             f"this call has {(B, Hq, Nq, Nk)}")
        if self.dtype != acc_t and any(n.kind == FLOAT for n in self.mod.expr.walk()):
            raise ValueError(f"block_mask evaluated its mask_mod's float arithmetic in "
                             f"{self.dtype}, this call computes in {np.dtype(acc_t)}: make it "
                             f"with block_mask(..., dtype={np.dtype(acc_t).name})")


def block_mask(mask_mod, B, H, Nq, Nk, *, block_size=128, dtype=np.float32, backend="auto"):
    """The BlockMask of mask_mod(b, h, q_idx, kv_idx) over B batch rows, H query heads,
    Nq queries and Nk keys. B or H None: the mask does not depend on it (evaluated at 0,
    serves any count). block_size: int or (rows, keys) of a tile. dtype: the
    accumulation dtype of the calls it serves (float64 for float64 inputs, float32 for
    the rest), in which the mask_mod's float arithmetic is done. backend: where the grid
    is evaluated — "cuda" (the GPU), "emulator", "numpy" (the host), or "auto" (the GPU
    where the mask_mod captures CuPy arrays, else the host); the kinds are the same."""
    mod = mask_mod if isinstance(mask_mod, Mod) else translate(mask_mod, "mask_mod")
    if mod.role != "mask_mod":
        raise ValueError(f"block_mask needs a mask_mod; got a {mod.role}")
    sizes = {"B": B, "H": H, "Nq": Nq, "Nk": Nk}
    for name, v in sizes.items():
        if v is None and name in ("B", "H"):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"block_mask: {name} must be a positive int"
                             + (" or None" if name in ("B", "H") else "") + f"; got {v!r}")
    bq, bk = (block_size, block_size) if np.isscalar(block_size) else tuple(block_size)
    if not all(isinstance(x, (int, np.integer)) and x >= 1 for x in (bq, bk)):
        raise ValueError(f"block_size must be a positive int or (rows, keys); got {block_size!r}")
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64; got {dtype!r}")
    Bm, Hm = B or 1, H or 1
    be = _dispatch.resolve_backend(backend, mod.buffers)
    if be.name != "numpy":
        return BlockMask(mod, _device_kinds(be, mod, Bm, Hm, Nq, Nk, bq, bk, dtype),
                         (bq, bk), Nq, Nk, dtype)
    # arrays captured on a GPU (CuPy) are read on the host: the grid is walked in NumPy
    host = mod._replace(buffers={n: a.get() if hasattr(a, "__cuda_array_interface__") else a
                                 for n, a in mod.buffers.items()})
    bound = Bound(host, dtype, {"b": (0, Bm - 1), "h": (0, Hm - 1), "q_idx": (0, Nq - 1),
                                "kv_idx": (0, Nk - 1)})
    nbq, nbk = -(-Nq // bq), -(-Nk // bk)
    kinds = np.empty((Bm, Hm, nbq, nbk), np.uint8)
    keys = max(bk, (_STRIP // max(1, Bm * Hm * bq)) // bk * bk)  # keys per strip
    env = {"b": np.arange(Bm)[:, None, None, None], "h": np.arange(Hm)[None, :, None, None]}
    for i in range(nbq):
        r0, r1 = i * bq, min((i + 1) * bq, Nq)
        env["q_idx"] = np.arange(r0, r1)[None, None, :, None]
        for c0 in range(0, Nk, keys):
            c1 = min(c0 + keys, Nk)
            env["kv_idx"] = np.arange(c0, c1)[None, None, None, :]
            m = np.broadcast_to(bound.value(env), (Bm, Hm, r1 - r0, c1 - c0))
            starts = np.arange(0, c1 - c0, bk)               # c0 is a multiple of bk
            seen = np.add.reduceat(m.sum(axis=2, dtype=np.int64), starts, axis=-1)
            size = (r1 - r0) * np.diff(np.append(starts, c1 - c0))
            kinds[:, :, i, c0 // bk:c0 // bk + len(starts)] = np.where(
                seen == 0, EMPTY, np.where(seen == size, FULL, PARTIAL))
    return BlockMask(mod, kinds, (bq, bk), Nq, Nk, dtype)


# Grid limits of the device path: query blocks on gridDim.y, B·H on gridDim.z; a tile's
# elements counted in a 32-bit int
_GRID_YZ, _TILE_ELEMENTS = 65535, 2**31 - 1


def _device_kinds(backend, mod, Bm, Hm, Nq, Nk, bq, bk, dtype):
    """kinds (Bm, Hm, ⌈Nq/bq⌉, ⌈Nk/bk⌉) as a NumPy array, from block_mask.cu on a kernel
    backend (cuda or emulator): indices outside a captured array are clamped, except in
    the emulator's checked mode, which reports the read (as the attention kernels)."""
    from ..plans.block_mask import BlockMaskPlan
    from .cuda_c import kernel_mods, mod_args
    nbq, nbk = -(-Nq // bq), -(-Nk // bk)
    for what, n, limit in (("query blocks ⌈Nq / block_size⌉", nbq, _GRID_YZ),
                           ("B · H", Bm * Hm, _GRID_YZ),
                           ("elements per tile", bq * bk, _TILE_ELEMENTS)):
        if n > limit:
            raise ValueError(f"block_mask on backend={backend.name!r}: {what} = {n} exceeds "
                             f"{limit}; use larger (or smaller) blocks, or backend='numpy'")
    # the captured arrays where the backend computes (a clear error for GPU arrays on
    # the emulator)
    mod = mod._replace(buffers=dict(zip(mod.buffers, _dispatch.bring(backend, mod.buffers))))
    xp = backend.xp
    clamp = not (backend.name == "emulator" and backend.module_options.get("checked"))
    mods = kernel_mods(xp, None, mod, dtype, clamp=clamp)
    plan = BlockMaskPlan(np.dtype(dtype).name)
    kinds = xp.empty((Bm, Hm, nbq, nbk), np.uint8)
    backend.get_function(plan, mods)(
        (nbk, nbq, Bm * Hm), (plan.num_threads,),
        (kinds, *(np.int32(x) for x in (Hm, Nq, Nk, bq, bk)), *mod_args(mods)))
    return kinds.get() if hasattr(kinds, "get") else kinds


def tile_kinds(bm, b, heads, i, j):
    """The kind of tile (i, j) for batch row b and the query heads `heads` taken together
    (a tile of several heads' rows): EMPTY if empty for all, FULL if full for all, else
    PARTIAL."""
    k = bm.kinds[b if bm.kinds.shape[0] > 1 else 0]
    k = k[heads if k.shape[0] > 1 else slice(0, 1), i, j]
    lo, hi = int(k.min()), int(k.max())
    return lo if lo == hi else PARTIAL

