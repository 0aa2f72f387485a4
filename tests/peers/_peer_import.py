"""Load the peers' own source files from unpacked wheels, with their heavy dependencies stubbed.

Only the peer's files are executed (their functions are called as shipped); nothing of theirs is copied here.
Third-party modules a peer file imports but never uses in the functions under test (ray, transformers, vllm,
megatron, ...) are replaced by permissive stub modules. The peer's own packages are entered without running
their ``__init__`` files (which import whole trainers), so only the modules the tests ask for are executed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


class _DummyMeta(type):
    """Metaclass of stub objects: any attribute is another stub, indexing returns the stub itself."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _dummy(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __add__(cls, other: Any) -> Any:  # ``Base._FIELDS + [...]`` in a subclass body keeps the subclass's part
        return other

    def __radd__(cls, other: Any) -> Any:
        return other

    def __ror__(cls, other: Any) -> Any:
        return cls


class _Dummy(metaclass=_DummyMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Used as a decorator factory's result (``@deprecated("...")``): hand the decorated object back.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Dummy()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Dummy()

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())


def _dummy(name: str) -> type:
    return _DummyMeta(name.rsplit(".", 1)[-1], (_Dummy,), {"__qualname__": name, "__module__": name})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _dummy(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _PeerPackage(types.ModuleType):
    """A peer package entered without running its ``__init__`` up front.

    An attribute is a submodule when one exists; otherwise the package's ``__init__`` is run once (re-exports
    such as ``from .functional import ppo_actor_loss_fn``) and, if the name is still missing or ``__init__``
    fails on something stubbed, the attribute is a stub.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        for base in self.__path__:
            if (Path(base) / f"{name}.py").exists() or (Path(base) / name).is_dir():
                return importlib.import_module(f"{self.__name__}.{name}")
        if not self.__dict__.get("_init_ran", False):
            self.__dict__["_init_ran"] = True
            init = Path(self.__path__[0]) / "__init__.py"
            if init.exists():
                # An __init__ that needs a real trainer fails: the missing names become stubs below.
                with contextlib.suppress(Exception):
                    exec(compile(init.read_text(), str(init), "exec"), self.__dict__)
            if name in self.__dict__:
                return self.__dict__[name]
        value = _dummy(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def __init__(self, package_dir: Path | None = None, version: str = "99.0.0") -> None:
        self.package_dir = package_dir
        self.version = version

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.package_dir is not None:
            mod: types.ModuleType = _PeerPackage(spec.name)
            mod.__path__ = [str(self.package_dir)]
            mod.__version__ = self.version
        else:
            mod = _StubModule(spec.name)
            mod.__path__ = []
            mod.__version__ = "99.0.0"  # version gates (``Version(x.__version__) >= ...``) take the newest branch
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: dict[str, Path], stubs: Iterable[str], versions: dict[str, str]) -> None:
        self.roots = roots
        self.versions = versions
        self.stubs = set(stubs)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".")[0]
        if top in self.roots:
            rel = Path(*fullname.split("."))
            candidate = self.roots[top] / rel
            if candidate.is_dir():
                return importlib.util.spec_from_loader(
                    fullname, _StubLoader(candidate, self.versions.get(top, "0")), is_package=True
                )
            return None  # a real .py file: the path finder loads it from the parent's __path__
        if top in self.stubs:
            return importlib.util.spec_from_loader(fullname, _StubLoader(), is_package=True)
        return None


@contextlib.contextmanager
def wheel_cache_lock(directory: Path) -> Iterator[None]:
    """Held while pinned wheels are downloaded into and unpacked in the cache ``directory``. Test processes running
    side by side (pytest-xdist's workers; the peers tier and tests/integration share the cache) must not read a
    wheel or a file that another is still writing."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def peer_imports(
    roots: dict[str, Path],
    stubs: Iterable[str],
    versions: dict[str, str] | None = None,
    loaded: dict[str, types.ModuleType] | None = None,
) -> Iterator[None]:
    """While active, ``import <peer>.x.y`` loads the unpacked files under ``roots`` (each maps a top-level package
    name to the folder that holds it) and the modules in ``stubs`` that are not installed are permissive stubs.

    On exit the finder, the stub modules and the peer modules themselves leave ``sys.modules``/``sys.meta_path``
    again (the peer modules go to ``loaded`` when given; what stood under their names before comes back), so the
    rest of the test session never sees a fake ``transformers`` nor the wheel's ``trl`` in place of the installed
    one: a TRL test run later in the same process (a pytest-xdist worker) imports the real package.
    """
    stub_names = {s for s in stubs if s not in sys.modules and importlib.util.find_spec(s) is None}
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in roots}
    finder = _Finder(roots, stub_names, versions or {})
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            top = name.split(".")[0]
            if top in roots:
                module = sys.modules.pop(name)
                if loaded is not None:
                    loaded[name] = module
            elif top in stub_names:
                del sys.modules[name]
        sys.modules.update(saved)
        _forget_availability_checks()


@contextlib.contextmanager
def peer_modules_installed(loaded: dict[str, types.ModuleType]) -> Iterator[None]:
    """While active, the modules ``loaded`` by :func:`peer_imports` stand in ``sys.modules`` (a peer function
    importing a sibling module at call time finds its own); on exit the installed packages of the same names come
    back, and peer modules imported meanwhile join ``loaded``."""
    tops = {name.split(".")[0] for name in loaded}
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] in tops}
    sys.modules.update(loaded)
    try:
        yield
    finally:
        for name in list(sys.modules):
            if name.split(".")[0] in tops:
                loaded[name] = sys.modules.pop(name)
        sys.modules.update(saved)


def _forget_availability_checks() -> None:
    """transformers caches its "is X installed" checks (``functools.lru_cache``) at their first call. Made while the
    stubs stood in for missing packages (torchvision, PIL), they would claim those for the rest of the process, and a
    later real ``from transformers import AutoProcessor`` (TRL's trainer) would try to import them."""
    checks = sys.modules.get("transformers.utils.import_utils")
    for value in vars(checks).values() if checks is not None else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
