"""benchmarks/sass_check.py: uniform registers read before any write in SASS text (the ptxas 12.8
fault of the v10 backward item kernel), on hand-written ``nvdisasm -c`` listings: the fault's
own pattern is found, correct code is not, and the data flow follows branches."""

from __future__ import annotations

from tests.support.scripts import load_script


def _load():
    return load_script("benchmarks/sass_check.py")


def _sass(*lines: str) -> str:
    """nvdisasm -c text: labels as given, instructions at 16-byte addresses."""
    out, addr = [], 0
    for line in lines:
        if line.startswith(".L_x_"):
            out.append(line)
            continue
        out.append(f"        /*{addr:04x}*/                   {line} ;")
        addr += 16
    return "\n".join(out) + "\n"


def test_the_item_kernel_fault_is_found():
    # ptxas 12.8's prologue of the v10 item kernel: a descriptor pair advanced from registers
    # nothing wrote, then a product reading them
    text = _sass("S2UR UR7, SR_CgaCtaId", "UIADD3 UR30, UP0, UR30, 0x40, URZ",
                 "UIADD3.X UR31, UR31, -0x7fffffe0, URZ, UP0, !UPT",
                 "UMOV UR28, UR7", "UMOV UR29, 0x40000040",
                 "HGMMA.64x32x16.F32.BF16 R152, gdesc[UR28].tnspA.tnspB, R152", "EXIT")
    assert _load().uninitialized_uniform_reads(text) == [
        (0x10, "UR30", "UIADD3"), (0x20, "UR31", "UIADD3.X")]


def test_written_registers_pass():
    text = _sass("ULDC.64 UR4, c[0x0][0x210]", "UMOV UR30, 0x1040", "UMOV UR31, 0x80000020",
                 "UIADD3.64 UR28, UR4, 0x100, URZ", "UIMAD.WIDE UR8, UR4, 0x4, URZ",
                 "HGMMA.64x32x16.F32.BF16 R152, gdesc[UR28].tnspA.tnspB, RZ, !UPT",
                 "LDG.E R2, desc[UR8][R4.64]", "STS [UR5], R0", "EXIT")
    assert _load().uninitialized_uniform_reads(text) == []


def test_operand_forms():
    check = _load().uninitialized_uniform_reads
    # A in registers: only B's descriptor (UR6, UR7) is read
    assert check(_sass("UMOV UR6, 0x40", "UMOV UR7, 0x40000040",
                       "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR4].tnspB, R88", "EXIT")) == []
    # A from shared memory: all four
    assert [r for _, r, _ in check(_sass(
        "UMOV UR6, 0x40", "UMOV UR7, 0x40000040",
        "HGMMA.64x32x16.F32.BF16 R152, gdesc[UR4].tnspA, R152", "EXIT"))] == ["UR4", "UR5"]
    # a 64-bit uniform operation reads a pair; a store's address register is read, not written
    assert [r for _, r, _ in check(_sass("UMOV UR28, 0x1", "UIADD3.64 UR36, UR28, 0x100, URZ",
                                         "STS [UR40], R0", "EXIT"))] == ["UR29", "UR40"]
    # URZ is always zero
    assert check(_sass("UIADD3 UR4, URZ, 0x1, URZ", "EXIT")) == []


def test_branches():
    check = _load().uninitialized_uniform_reads
    # written on one path (the branch may fall through): counted as written
    assert check(_sass("@P0 BRA `(.L_x_1)", "UMOV UR4, 0x1", ".L_x_1:",
                       "UIADD3 UR5, UR4, 0x1, URZ", "EXIT")) == []
    # an unconditional branch over the only write: read unwritten
    assert check(_sass("BRA `(.L_x_1)", "UMOV UR4, 0x1", ".L_x_1:",
                       "UIADD3 UR5, UR4, 0x1, URZ", "EXIT")) == [(0x20, "UR4", "UIADD3")]
    # code after an unconditional EXIT is reached only through its label
    assert check(_sass("UMOV UR4, 0x1", "@P0 BRA `(.L_x_1)", "EXIT", ".L_x_1:",
                       "UIADD3 UR5, UR4, 0x1, URZ", "EXIT")) == []
    # a loop: written at the loop's end, read at its top, first written before the loop
    assert check(_sass("UMOV UR4, 0x1", ".L_x_0:", "UIADD3 UR5, UR4, 0x1, URZ",
                       "UMOV UR4, UR5", "@P0 BRA `(.L_x_0)", "EXIT")) == []
