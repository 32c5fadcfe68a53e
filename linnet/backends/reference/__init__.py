"""The NumPy reference backend: a plain interpreter of the Program, its executable definition."""
from linnet.backends.registry import BackendPackage

PACKAGE = BackendPackage(
    name="reference",
    modes=(("numpy", "Linnet, NumPy reference"),),
    dtypes=("f32",),
    group="Reference",  # not a group on the pages: it is not benched
    benched=False,
    runner="linnet.backends.reference.runner:NumpyRunner",
    check="linnet.backends.reference.runner:unavailable",
)
