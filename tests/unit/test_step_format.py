"""The step format is defined once (service/backends/step_format.py) and reaches the kernels as
-D defines: no kernel file may restate it, and the compile options carry every field."""

from __future__ import annotations

import re

from service.backends import step_format
from service.backends.cuda import sources as cuda_sources


def test_compile_options_carry_every_field_of_the_records():
    defines = dict(o[2:].split("=", 1) for o in cuda_sources.OPTIONS if o.startswith("-D"))
    for p in step_format.Param:
        assert defines[f"P_{p.name}"] == str(int(p))
    assert defines["N_PARAMS"] == str(len(step_format.Param))
    assert defines["TOP_MAX"] == str(step_format.TOP_MAX)
    assert defines["OUT_WORDS"] == str(2 + 2 * step_format.TOP_MAX)


def test_no_kernel_file_defines_a_shared_name_itself():
    names = set(step_format.cuda_defines())
    define = re.compile(r"^\s*#\s*define\s+(\w+)", re.M)
    for path in sorted(cuda_sources.CUDA_DIR.glob("*.cu*")):
        restated = names & set(define.findall(path.read_text()))
        assert not restated, f"cuda/{path.name} defines {sorted(restated)}: take them from -D"


def test_param_record_puts_each_field_at_its_word():
    rec = step_format.param_record(temperature=0.5, top_k=7, top_p=0.9, min_p=0.05,
                                   penalty=1.1, repeat_last_n=64, seed=(3 << 32) | 5,
                                   token_index=11, n_top=2, slot=4, position=99)
    P = step_format.Param
    assert len(rec) == step_format.N_PARAMS
    assert rec[P.TOP_K] == 7 and rec[P.REPEAT_LAST_N] == 64 and rec[P.N_TOP] == 2
    assert rec[P.SLOT] == 4 and rec[P.POSITION] == 99 and rec[P.TOKEN_INDEX] == 11
    assert (rec[P.SEED_LO], rec[P.SEED_HI]) == (5, 3)
    assert rec[P.TEMPERATURE] == step_format.f32_bits(0.5)
