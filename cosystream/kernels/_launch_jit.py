"""Programmatic dependent launch (PDL) for the Triton kernels (imported on first use: it needs Triton).

A kernel launched with PDL may start while the kernel before it in the stream is still running. Each such
kernel calls `follow_previous()` (under its `PDL` constexpr) before it reads or writes any memory another
kernel touches: it waits there until the kernel before it has finished and its writes are visible, which
holds transitively, since that kernel did the same. Then it lets the kernel after it launch. The launch and
the start-up of each kernel so leave the critical path; the order of the numbers does not change.
"""

import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_wait = gdc_launch_dependents = None

HAS_GDC = gdc_wait is not None


@triton.jit
def follow_previous():
    gdc_wait()
    gdc_launch_dependents()
