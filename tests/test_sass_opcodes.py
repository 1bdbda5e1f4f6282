"""benchmarks/sass.py's opcode count on cuobjdump-style SASS: every instruction, past byte offset 0xffff too."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import sass  # noqa: E402


def test_opcodes_count_instructions_past_offset_0xffff():
    text = "\n".join([
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */",
        "        /*fff0*/              @!P0 BRA `(.L_x_1) ;                           /* 0x0000000000008947 */",
        "        /*10000*/                   NOP ;                                    /* 0x0000000000007918 */",
        "        /*10010*/                   SHFL.BFLY PT, R3, R2, 0x10, 0x1f ;       /* 0x0e001f0002037f89 */",
        "        /*1a2b0*/                   EXIT ;                                   /* 0x000000000000794d */",
    ])
    assert sass.opcodes(text) == ["LDC", "BRA", "SHFL", "EXIT"]
