"""tools/sass_by_op.py's reading of `nvdisasm -gi` output (the disassembler itself needs the
CUDA toolkit and a CUDA build, which CI lacks)."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sass_by_op.py"
spec = importlib.util.spec_from_file_location("sass_by_op", TOOL)
sass = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass)

LISTING = """\
//--------------------- .text._ZN3nmk2mk10megakernelILi1EEEvNS0_6ParamsE --------------------------
\t.section\t.text._ZN3nmk2mk10megakernelILi1EEEvNS0_6ParamsE,"ax",@progbits
.text._ZN3nmk2mk10megakernelILi1EEEvNS0_6ParamsE:
\t//## File "/src/cuda/mk/vm.cuh", line 136
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
\t//## File "/src/cuda/mk/common.cuh", line 17 inlined at "/src/cuda/mk/common.cuh", line 337
\t//## File "/src/cuda/mk/common.cuh", line 337 inlined at "/src/cuda/mk/op_qkv.cuh", line 17
\t//## File "/src/cuda/mk/op_qkv.cuh", line 17 inlined at "/src/cuda/mk/vm.cuh", line 44
        /*0020*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E.128.CONSTANT R8, desc[UR4][R2.64+0x40] ;
\t//## File "/usr/local/cuda/include/cuda_bf16.hpp", line 585
        /*0040*/                   F2FP.BF16.F32.PACK_AB R0, R1, R0 ;
\t//## File "/src/cuda/mk/op_mlp.cuh", line 60 inlined at "/src/cuda/mk/vm.cuh", line 48
        /*0050*/                   HMMA.16816.F32.BF16 R12, R4, R8, R12 ;
\t//## File "/src/cuda/mk/vm.cuh", line 150
        /*0060*/                   EXIT ;
//--------------------- .text._ZN4nmk26sample6kernelEv --------------------------
.text._ZN4nmk26sample6kernelEv:
        /*0000*/                   EXIT ;
"""


def test_each_instruction_goes_to_the_op_its_inlining_chain_names():
    functions = sass.sass_by_op(LISTING)
    assert list(functions) == ["_ZN3nmk2mk10megakernelILi1EEEvNS0_6ParamsE", "_ZN4nmk26sample6kernelEv"]
    # vm.cuh's own code is "other"; the QKV loads and the bf16 helper after them are op_qkv's
    # (the helper names no op: the code it inlines into keeps its op); the mma is op_mlp's.
    assert functions["_ZN3nmk2mk10megakernelILi1EEEvNS0_6ParamsE"] == {"other": 3, "op_qkv.cuh": 3, "op_mlp.cuh": 1}
    assert functions["_ZN4nmk26sample6kernelEv"] == {"other": 1}
    text = sass.report(functions)
    assert "op_qkv.cuh" in text and f"{3 * 16 / 1024:8.1f} KB" in text


def test_a_file_without_a_cubin_or_tools_gives_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither cuobjdump nor nvdisasm
    assert sass.main([str(tmp_path / "libnorthmk.so")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuobjdump not found" in err[0]
    with pytest.raises(RuntimeError, match="cuobjdump not found"):
        sass.disassemble(tmp_path / "x.o")
