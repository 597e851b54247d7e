"""The native kernels' SIMD paths this CPU can run, by the names their `implementation=`
arguments take: the scalar one always, AVX2 and AVX-512 where the CPU offers them."""

from __future__ import annotations

from infinity import _native


def implementations() -> list[str]:
    level = _native.simd_level()
    found = ["scalar"]
    if level in ("avx2", "avx512"):
        found.append("avx2")
    if level == "avx512":
        found.append("avx512")
    return found
