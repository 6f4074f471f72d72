"""Programmatic dependent launch (PDL) for the Triton kernels (imported on first use: it needs Triton).

A kernel launched with PDL may start while the kernel before it in the stream is still running. Each such
kernel calls `follow_previous()` (under its `PDL` constexpr) before it reads or writes any memory another
kernel touches: it waits there until the kernel before it has finished and its writes are visible, which
holds transitively, since that kernel did the same. Then it lets the kernel after it launch. The launch and
the start-up of each kernel so leave the critical path; the order of the numbers does not change.
"""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_wait = gdc_launch_dependents = None

HAS_GDC = gdc_wait is not None


@triton.jit
def follow_previous():
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs, nbytes):
    """Asks the copy engine of the SM to bring `nbytes` [i32] from each address in `ptrs` into L2 (Hopper's
    cp.async.bulk.prefetch: a hint; nothing lands in registers, so it may run before `follow_previous`
    for memory no kernel writes, such as weights). Addresses 16-byte aligned, sizes multiples of 16; a size
    of 0 issues nothing."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
