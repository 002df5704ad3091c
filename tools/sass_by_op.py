"""How much of the megakernel's machine code each opcode holds.

    python tools/sass_by_op.py BUILD/libnorthmk.so   (or one megakernel_bN.cu.o, or a .cubin)

Every SM runs every opcode's code in turn, so the kernel's size is what its instruction cache
has to hold (benchmarks/NOTES.md, session 9: 590 KB of SASS at batch 8 before its per-task
loops stopped being unrolled). For each kernel in the file this prints its size and the KB of
instructions that each op_*.cuh inlined into it (the outermost op_*.cuh file of an
instruction's inlining chain, `nvdisasm -gi`; instructions outside every op are "other").
Needs cuobjdump and nvdisasm (the CUDA toolkit's, or the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels' on PATH); the build must carry line info (the CMake build's
-lineinfo).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/")
FUNCTION = re.compile(r"^\s*\.text\.(\S+):")
SOURCE = re.compile(r'"([^"]+)"')
BYTES_PER_INSTRUCTION = 16


def sass_by_op(disassembly: str) -> dict[str, Counter]:
    """Per function of `nvdisasm -gi` output, the instructions each op_*.cuh file holds: an
    instruction belongs to the first op_*.cuh named by the //## lines before it (innermost
    first, as nvdisasm prints the chain), to "other" when they name vm.cuh alone (the task
    loop itself), else to the previous instruction's op (a helper header's code inlined into
    it, whose chain nvdisasm may print without the op)."""
    out: dict[str, Counter] = {}
    function, current, chain = None, "other", []
    for line in disassembly.splitlines():
        named = FUNCTION.match(line)
        if named:
            function, current, chain = named.group(1), "other", []
            out.setdefault(function, Counter())
            continue
        if "//##" in line:
            chain += [Path(f).name for f in SOURCE.findall(line)]
            continue
        if function is not None and INSTRUCTION.match(line):
            if chain:
                ops = [f for f in chain if f.startswith("op_")]
                current = ops[0] if ops else ("other" if set(chain) == {"vm.cuh"} else current)
                chain = []
            out[function][current] += 1
    return out


def demangle(name: str) -> str:
    """The C++ name, where c++filt is there to say it."""
    if not shutil.which("c++filt"):
        return name
    return subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip() or name


def report(functions: dict[str, Counter]) -> str:
    lines = []
    for name, counts in functions.items():
        total = sum(counts.values())
        if not total:
            continue
        lines.append(f"{demangle(name)}: {total * BYTES_PER_INSTRUCTION / 1024:.1f} KB")
        for op, n in counts.most_common():
            lines.append(f"  {op:24s} {n * BYTES_PER_INSTRUCTION / 1024:8.1f} KB")
    return "\n".join(lines)


def disassemble(path: Path) -> str:
    """nvdisasm -gi of every cubin in path (a cubin itself, or an object or library holding some)."""
    for tool in ("cuobjdump", "nvdisasm"):
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} not found on PATH (the CUDA toolkit's bin, or its pip wheel's)")
    with tempfile.TemporaryDirectory() as tmp:
        if path.suffix == ".cubin":
            cubins = [path]
        else:
            subprocess.run(["cuobjdump", "-xelf", "all", str(path.resolve())], cwd=tmp, check=True,
                           capture_output=True, text=True)
            cubins = sorted(Path(tmp).glob("*.cubin"))
        if not cubins:
            raise RuntimeError(f"{path}: no cubin in it (a build without CUDA?)")
        return "\n".join(subprocess.run(["nvdisasm", "-gi", "-c", str(c)], check=True, capture_output=True,
                                        text=True).stdout for c in cubins)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="libnorthmk.so, a megakernel object file or a cubin")
    args = parser.parse_args(argv)
    try:
        functions = sass_by_op(disassemble(args.path))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        print(f"sass_by_op: {exc} {detail.strip()}".strip(), file=sys.stderr)
        return 1
    print(report(functions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
