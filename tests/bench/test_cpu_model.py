"""cpu_model: the processor's name for manifests and profiles, read from the first processor's block."""

import platform

from cbjax.bench.results import cpu_model

_TWO_CPUS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: Other CPU
"""


def test_reads_the_first_processor_with_family_and_model(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(_TWO_CPUS)
    assert cpu_model(str(path)) == "AMD EPYC (family 26, model 2)"


def test_name_alone_when_family_and_model_are_missing(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Some ARM core\n")
    assert cpu_model(str(path)) == "Some ARM core"


def test_falls_back_to_platform_without_cpuinfo(tmp_path):
    assert cpu_model(str(tmp_path / "missing")) == (platform.processor() or platform.machine())
