from linnet.bench import machine


def test_vector_units_name_the_widest_the_cpu_has():
    zen3 = {"fpu", "sse2", "avx", "fma", "avx2", "bmi2"}
    zen5 = zen3 | {"avx512f", "avx512bw", "avx512_bf16"}
    sapphire_rapids = zen5 | {"amx_tile", "amx_bf16", "amx_int8"}
    assert machine.vector_units(zen3) == ["AVX2"]
    assert machine.vector_units(zen5) == ["AVX-512"]
    assert machine.vector_units(sapphire_rapids) == ["AVX-512", "AMX"]
    assert machine.vector_units({"sse2"}) == []


def test_the_cpu_line_carries_model_units_and_cores():
    line = machine.cpu()
    assert line.endswith(f", {machine.cores()} cores")
    units = machine.vector_units(machine.cpu_flags())
    if units:
        assert f"({', '.join(units)})" in line
