"""Uniform registers a kernel's SASS reads before any write: a CPU check of compiled cubins.

ptxas 12.8 (the one in Triton 3.6's wheel) compiled the v10 backward item kernel at 128 keys so
that the shared-memory descriptors of one product were computed from two uniform registers no
instruction had written (``UIADD3 UR30, UP0, UR30, 0x40`` in the prologue); on the H200 they held
a previous kernel's values and the product read shared memory out of bounds
(benchmarks/NOTES.md, "v10 backward: out-of-bounds shared read on the GPU"). The interpreter,
the shared-memory size and the TTGIR's buffer offsets show nothing; the SASS does.
:func:`uninitialized_uniform_reads` finds such reads in ``nvdisasm -c`` text with a data flow
over the kernel's branches: a register counts as written at an instruction when some path from
the entry writes it first, so every hit is certain (a register written only later in a loop is
not reported). ``sm90_shared_memory.py compile`` runs it on every kernel it compiles.

Usage: ``python benchmarks/sass_check.py KERNEL.cubin...`` (exit status 1 on a hit).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

# SASS opcodes (the part before the first '.') whose first operand is not a destination.
_NO_DEST = {"ST", "STS", "STG", "STL", "STSM", "STAS", "RED", "REDG", "REDAS", "BAR", "BRA", "BRX",
            "JMP", "JMX", "EXIT", "RET", "CALL", "FENCE", "MEMBAR", "BSYNC", "WARPSYNC", "NOP",
            "ERRBAR", "CGAERRBAR", "CCTL", "YIELD", "DEPBAR", "UTMALDG", "UTMASTG", "UTMAPF",
            "UTMACCTL", "UTMAREDG", "UBLKCP", "UBLKRED", "UBLKPF", "BPT", "KILL", "NANOSLEEP",
            "PREEXIT", "WARPGROUP"}


def _operands(text: str) -> list:
    """Operands of one SASS instruction (commas inside brackets do not split)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch in "[("
        depth -= ch in "])"
        cur += ch
    return out + [cur.strip()] if cur.strip() else out


def parse_sass(text: str) -> list:
    """``nvdisasm -c`` text -> one ``(address, label, opcode, guard, written, read, target)`` per
    instruction: the uniform registers (numbers) it writes and reads (``gdesc[URn]``: the four
    registers of a warpgroup MMA's two descriptors, the upper two when A is in registers;
    ``desc[URn]``: a pair; 64-bit uniform operations: pairs), the label just above it and its
    branch target."""
    out, label = [], None
    for raw in text.splitlines():
        mark = re.match(r"^(\.L_x_\d+):", raw)
        if mark:
            label = mark.group(1)
            continue
        line = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", raw)
        if not line:
            continue
        body, guard = line.group(2), None
        pred = re.match(r"@(!?U?P[T0-9]+)\s+", body)
        if pred:
            guard, body = pred.group(1), body[pred.end():]
        op, _, rest = body.partition(" ")
        base = op.split(".")[0]
        pairs = base.startswith("U") and ".64" in op
        written, read = [], []
        operands = _operands(rest)
        # a warpgroup MMA with A in registers reads only B's descriptor (the upper pair)
        a_regs = base == "HGMMA" and len(operands) > 1 and re.fullmatch(r"R\d+", operands[1])
        for i, operand in enumerate(operands):
            for m in re.finditer(r"gdesc\[UR(\d+)\]", operand):
                read += range(int(m.group(1)) + 2 * bool(a_regs), int(m.group(1)) + 4)
            for m in re.finditer(r"(?<![a-z])desc\[UR(\d+)\]", operand):
                read += range(int(m.group(1)), int(m.group(1)) + 2)
            plain = re.sub(r"g?desc\[UR\d+\]", "", operand)
            if i == 0 and base not in _NO_DEST and re.fullmatch(r"UR\d+(\.\w+)*", plain):
                n = int(plain[2:].split(".")[0])
                written += [n, n + 1] if pairs or ".WIDE" in op else [n]
                continue
            for m in re.finditer(r"UR(\d+)", plain):
                n = int(m.group(1))
                read += [n, n + 1] if pairs and not plain.startswith("[") else [n]
        target = re.search(r"`\((\.L_x_\d+)\)", rest)
        out.append((int(line.group(1), 16), label, op, guard, written, read,
                    target.group(1) if target else None))
        label = None
    return out


def uninitialized_uniform_reads(text: str) -> list:
    """``(address, 'URn', opcode)`` for each uniform register an instruction reads that no path
    from the kernel's entry writes before it (a may-be-written data flow over the branches of
    ``nvdisasm -c`` text; URZ excluded). Registers hold no defined value at launch, so any hit is
    a read of another kernel's leftovers."""
    ins = parse_sass(text)
    labels = {ins[i][1]: i for i in range(len(ins)) if ins[i][1]}
    succ = []
    for i, (_, _, op, guard, _, _, target) in enumerate(ins):
        base = op.split(".")[0]
        nxt = [i + 1] if i + 1 < len(ins) else []
        if base in ("BRA", "JMP") and target is not None:
            succ.append([labels[target]] + (nxt if guard else []))
        elif base in ("EXIT", "RET", "BRX", "JMX") and guard is None:
            succ.append([])
        else:
            succ.append(nxt)
    seen = [None] * len(ins)
    seen[0] = frozenset()
    work = [0] if ins else []
    while work:
        i = work.pop()
        after = seen[i] | frozenset(ins[i][4])
        for j in succ[i]:
            new = after if seen[j] is None else seen[j] | after
            if new != seen[j]:
                seen[j] = new
                work.append(j)
    return [(addr, f"UR{r}", op) for i, (addr, _, op, _, _, read, _) in enumerate(ins)
            if seen[i] is not None for r in dict.fromkeys(read) if r != 255 and r not in seen[i]]


def sass_text(cubin: bytes):
    """``nvdisasm -c`` of a cubin with the nvdisasm of Triton's wheel, or None without one."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    bad = 0
    for path in argv:
        with open(path, "rb") as f:
            text = sass_text(f.read())
        if text is None:
            print("no nvdisasm in this Triton wheel")
            return 2
        hits = uninitialized_uniform_reads(text)
        bad += bool(hits)
        print(path, " ".join(f"{r}@{a:#x}({op})" for a, r, op in hits) or "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
