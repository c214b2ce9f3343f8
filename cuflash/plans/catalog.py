"""Every kernel specialization the library can launch: a finite list, what the compile
gate compiles and `check-kernels` prints."""
from __future__ import annotations

from .simt_bwd import all_simt_bwd_plans
from .simt_fwd import all_simt_fwd_plans
from .softmax import all_softmax_plans
from .tc_bwd import all_tc_bwd_plans, all_tf32_bwd_plans
from .tc_fwd import all_tc_plans, all_tf32_plans


def every_plan(cc=None) -> dict:
    """{name expression: plan} of every kernel specialization the library can launch on a
    device of compute capability `cc` (None: on any device): every plan of every family,
    dtype and head-dim bucket. A few tiles depend on `cc` (16-bit forward tiles on sm_86,
    sm_89 and sm_120, float32's split-tf32 tiles on sm_100 and sm_120, a 16-bit backward
    tile on sm_75: per-arch replacements in `tc_fwd` and `tc_bwd`)."""
    plans = (*all_simt_fwd_plans(), *all_tc_plans(cc), *all_tf32_plans(cc),
             *all_simt_bwd_plans(), *all_tc_bwd_plans(cc), *all_tf32_bwd_plans(cc),
             *all_softmax_plans())
    return {p.name_expression: p for p in plans}


def specializations(cc=None) -> dict[str, list[str]]:
    """every_plan(cc) as {source: [name expression]}, for the compile gate."""
    out: dict[str, list[str]] = {}
    for name, plan in every_plan(cc).items():
        out.setdefault(plan.source, []).append(name)
    return out
