"""The records the kernels take (common.cuh's Strides, seqlens.cuh's SeqLayout) against the
NumPy dtypes the launch path fills: every field at the C struct's offset, and the same
size. A field renamed, reordered or retyped on one side only would hand the kernels wrong
numbers without an error."""
import numpy as np
import pytest

from cuflash import compiler, emulator
from cuflash.backends import marshal

RECORDS = [("cuflash::Strides", marshal.STRIDES), ("cuflash::SeqLayout", marshal.LAYOUT)]


def c_layout(ctype: str, names) -> list:
    """[sizeof, offsetof(each name)...] of `ctype`, as the kernels' own headers define it."""
    exprs = [f"sizeof({ctype})"] + [f"__builtin_offsetof({ctype}, {n})" for n in names]
    body = "\n".join(f"    out[{i}] = (long long)({e});" for i, e in enumerate(exprs))
    code = ('#include "seqlens.cuh"\n'
            f'extern "C" __global__ void layout(long long* out) {{\n{body}\n}}\n')
    out = np.full(len(exprs), -1, np.int64)
    mod = emulator.RawModule(code=code, options=compiler.nvrtc_options())
    mod.get_function("layout")((1,), (1,), (out,))
    return out.tolist()


@pytest.mark.parametrize("ctype, dtype", RECORDS, ids=[c for c, _ in RECORDS])
def test_record_dtype_matches_the_c_struct(ctype, dtype):
    names = dtype.names
    assert c_layout(ctype, names) == [dtype.itemsize] + [dtype.fields[n][1] for n in names]


def test_a_record_of_another_size_is_refused_at_launch():
    """The emulator (as CuPy would pass the wrong bytes) names the argument and both sizes."""
    code = ('#include "common.cuh"\n'
            'extern "C" __global__ void k(cuflash::Strides st, long long* out) { out[0] = st.r; }\n')
    mod = emulator.RawModule(code=code, options=compiler.nvrtc_options())
    short = np.dtype([("b", np.int64), ("h", np.int64)])
    out = np.zeros(1, np.int64)
    with pytest.raises(TypeError, match="24-byte struct"):
        mod.get_function("k")((1,), (1,), (marshal.record(short, 1, 2), out))
    mod.get_function("k")((1,), (1,), (marshal.record(marshal.STRIDES, 1, 2, 3), out))
    assert out[0] == 3
