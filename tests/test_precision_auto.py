"""--mixed_precision=auto: bfloat16 only where the hardware computes it."""

import pytest

from framework import ConfigError
from framework.core import precision


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "fma"}, "float32"),
    ({"avx512f", "avx512_bf16"}, "bfloat16"),
    ({"amx_bf16", "amx_tile"}, "bfloat16"),
    (set(), "float32"),
])
def test_cpu_flags_decide(flags, expected):
  assert precision.resolve_precision("auto", flags=flags,
                                     gpu_bfloat16=None) == expected


@pytest.mark.parametrize("gpu,expected", [(True, "bfloat16"),
                                          (False, "float32")])
def test_a_gpu_decides_over_the_cpu(gpu, expected):
  assert precision.resolve_precision(
      "auto", flags={"avx512_bf16"}, gpu_bfloat16=gpu) == expected


def test_explicit_choices_pass_through_and_bad_ones_fail():
  for name in precision.PRECISIONS:
    assert precision.resolve_precision(name) == name
  with pytest.raises(ConfigError, match="mixed_precision"):
    precision.resolve_precision("int8")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n")
  assert precision.cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
  assert precision.cpu_flags(str(tmp_path / "missing")) == set()
