"""Generated source imported from a real file (under the cache root), for every backend that generates it."""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from types import ModuleType

from linnet.files import atomic_write
from linnet.weight_cache import cache_root


def load_generated_module(source: str, kind: str) -> ModuleType:
    """``source`` as the module ``linnet_<kind>_<digest>``, from a file so that tracebacks, profiles and
    torch.compile see its lines; registered in ``sys.modules``, since torch.compile re-imports the
    modules of globals by name."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = cache_root() / "generated" / f"linnet_{kind}_{digest}.py"
    if not path.is_file():  # written whole or not at all: another process may be importing it
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_text(source))
    if path.stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None  # a .py file always has both
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    return sys.modules[path.stem]
