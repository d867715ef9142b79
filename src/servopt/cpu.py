"""What a CPU can do fast, and do right, from its feature flags: the instruction-set ladder servopt measures against
(``Isa``), the features a CPU has (``CpuFeatures``) and the INT8 products a model can run (``Int8Kernel``).

Values only, no reading of the machine (``machine`` reads /proc/cpuinfo): a record's ``Environment`` names its CPU's
rung (``Environment.isa``) and tests inject the features they are about.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class Isa(StrEnum):
    """The x86 instruction-set ladder servopt measures against, poorest first: the one declaration of it. A target
    names one; a machine's is ``CpuFeatures.level``; runtimes map it to their own caps (``Runtime.isa_cap_env``)."""

    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_VNNI = "avx512_vnni"
    AMX = "amx"

    @property
    def rank(self) -> int:
        return list(Isa).index(self)

    # Every comparison by rank: str's own (alphabetical) ones would otherwise answer for the ones not defined here.
    def __lt__(self, other: object) -> bool:
        return self.rank < Isa(other).rank

    def __le__(self, other: object) -> bool:
        return self.rank <= Isa(other).rank

    def __gt__(self, other: object) -> bool:
        return self.rank > Isa(other).rank

    def __ge__(self, other: object) -> bool:
        return self.rank >= Isa(other).rank


def richer(level: Isa | str | None, than: Isa | str | None) -> bool:
    """Whether ``level`` is richer than ``than`` on the ladder; a level off the ladder (ARM, baseline x86) never is."""
    try:
        return level is not None and than is not None and Isa(level) > Isa(than)
    except ValueError:
        return False


# The INT8 product a model runs on x86, by activations × weights: "u8s8" (8-bit s8 weights: summed in saturating int16
# pairs without VNNI), "u8s8-7bit" (7-bit weights: no pair can overflow), "u8u8" (16-bit products), "s8s8" (signed
# activations: fast in ONNX Runtime only with AVX-VNNI-INT8 or ARM dot products). A quantizer says which its model
# is (``Pass.int8_kernel``), a runtime what it runs of it (``Runtime.int8_kernel``), the CPU what it computes fast
# and right (``CpuFeatures.int8_trouble``).
Int8Kernel = Literal["u8s8", "u8s8-7bit", "u8u8", "s8s8"]


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU can do fast, from its feature flags. ``level`` is the richest instruction set of the ladder
    servopt measures against (targets name one: ``avx2`` < ``avx512`` < ``avx512_vnni`` < ``amx``)."""

    flags: frozenset[str]

    @property
    def int8_dot(self) -> bool:
        """8-bit dot-product instructions (VNNI on x86, SDOT/UDOT on ARM): INT8 with signed activations is fast."""
        return bool(self.flags & {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"})

    @property
    def int8_signed(self) -> bool:
        """Fast INT8 with signed activations (S8S8) in ONNX Runtime. MLAS dispatches its S8S8 kernels to VNNI only with
        AVX-VNNI-INT8 on x86 (``platform.cpp``: AVX512-VNNI and AMX speed up U8S8 alone), and to SDOT/SMMLA on ARM.
        Measured on a Zen 4 EPYC with AVX512-VNNI: S8S8 QOperator 27 ms vs U8S8 1.9 ms on the demo MobileNetV2."""
        return bool(self.flags & {"avx_vnni_int8", "asimddp", "i8mm"})

    @property
    def int8_saturates(self) -> bool:
        """x86 without 8-bit dot products: ONNX Runtime computes U8S8 with ``vpmaddubsw``, whose 16-bit intermediate
        saturates when two u8×s8 products add past 32767 (ORT's docs; ``session.x64quantprecision``). Weights in 7 bits
        (``reduce_range``, NNCF's overflow fix) cannot overflow; U8U8 does not either, more slowly."""
        x86 = bool(self.flags & {"avx2", "avx512f"})
        return x86 and not self.int8_dot

    def without_dot_products(self) -> CpuFeatures:
        """This CPU as a target without 8-bit dot products sees INT8 (an AVX2 EPYC, for weights built on a VNNI Xeon)."""
        return CpuFeatures(self.flags - {"avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8"})

    def int8_trouble(self, kernel: Int8Kernel | None) -> str | None:
        """What goes wrong with ``kernel`` on this CPU, or None: full-range U8S8 saturates without VNNI (static U8S8 lost
        5.43 points on the demo on an AVX2 Zen 3, where 7-bit weights lost 0.54); S8S8 runs slower than fp32 without
        fast signed kernels (QDQ S8S8 at half ORT fp32's speed there)."""
        if kernel == "u8s8" and self.int8_saturates:
            return "its 8-bit U8S8 sums saturate in int16 without VNNI"
        if kernel == "s8s8" and not self.int8_signed and bool(self.flags & {"avx2", "avx512f"}):
            return "signed INT8 activations run slowly without AVX-VNNI-INT8"
        return None

    @property
    def nchwc_block(self) -> int | None:
        """The channel block ONNX Runtime's layout optimizer (level "all") writes convolutions in: MLAS's
        ``NchwcBlockSize``, 16 floats with AVX-512F, 8 with AVX2; None where servopt does not know it (ARM, older x86).
        A graph saved at that level keeps its weights in that block's order, and a CPU with another block runs it
        without complaint and answers wrongly: the demo MobileNetV2 saved on an AVX-512 Zen 4 scored 9.8 % top-1
        (chance: 10 classes) on an AVX2 CPU (qemu's EPYC-Milan, ``benchmarks/avx2_quality.py``)."""
        return self.nchwc_block_of(self.level)

    @staticmethod
    def nchwc_block_of(level: Isa | str | None) -> int | None:
        """The NCHWc block of a CPU at rung ``level`` of the ladder (this one's, a target's), None off the ladder."""
        try:
            return 16 if Isa(level) >= Isa.AVX512 else 8  # type: ignore[arg-type]
        except ValueError:
            return None

    @property
    def bf16(self) -> bool:
        return bool(self.flags & {"avx512_bf16", "amx_bf16", "bf16"})

    @property
    def fp16(self) -> bool:
        """Native fp16 arithmetic (not just conversion, which F16C gives)."""
        return bool(self.flags & {"avx512_fp16", "amx_fp16", "asimdhp", "fphp"})

    @property
    def amx(self) -> bool:
        return bool(self.flags & {"amx_int8", "amx_bf16"})

    @property
    def level(self) -> Isa | str:
        """The richest rung of the ``Isa`` ladder this CPU reaches; ``arm`` or ``baseline`` off the ladder."""
        if self.amx:
            return Isa.AMX
        if "avx512_vnni" in self.flags:
            return Isa.AVX512_VNNI
        if "avx512f" in self.flags:
            return Isa.AVX512
        if "avx2" in self.flags:
            return Isa.AVX2
        return "arm" if self.flags & {"asimd", "sve"} else "baseline"

    def describe(self) -> str:
        parts = [str(self.level)]
        parts += [name for name, on in (("VNNI/dot-product INT8", self.int8_dot),
                                        ("signed INT8", self.int8_signed), ("bf16", self.bf16), ("fp16", self.fp16),
                                        ("AMX", self.amx)) if on]
        return ", ".join(parts)


# The x86 features each rung of the ladder adds: reading a CPU as if it stopped at a rung drops every later rung's.
RUNG_FEATURES = {
    Isa.AVX2: frozenset({"avx2", "fma", "f16c"}),
    Isa.AVX512: frozenset({"avx512f", "avx512bw", "avx512vl"}),
    Isa.AVX512_VNNI: frozenset({"avx512_vnni", "avx_vnni", "avx_vnni_int8", "avx512_bf16", "avx512_fp16"}),
    Isa.AMX: frozenset({"amx_tile", "amx_int8", "amx_bf16", "amx_fp16"}),
}
def capped_features(features: CpuFeatures, rung: Isa) -> CpuFeatures:
    """``features`` without those of the rungs above ``rung``."""
    dropped = frozenset().union(*(f for r, f in RUNG_FEATURES.items() if r > rung))
    return CpuFeatures(features.flags - dropped)
