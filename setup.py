"""The compiled core: one Rust crate (rust/, PyO3) built as the extension module
kvledger._core — the router's holder-mask table and the envelope's Avro coder. See
rust/README.md for what lives where and why.

It is built for CPython's stable ABI (abi3, 3.11 and later: one build serves every later
version). Where no Rust toolchain is found the build goes on without it (set
KVLEDGER_REQUIRE_CORE=1 to make that an error, as CI does): what an engine needs to
publish still works (the codec is then fastavro's, with the same bytes), and the router
index, the core's alone, says in one line that it needs it; `kvledger --version` says
which parts are in use.

`pip install -e .` is a strict editable install: setuptools links each of the package's
files into build/__editable__.*/ and puts that folder on sys.path. Its default instead
adds an import hook that Python consults only after the path, so a folder named kvledger
in the working directory (the clone itself, seen from the folder that holds it) would be
imported in its place as an empty namespace package. A module added or removed needs the
install again (`make venv` does it when the package's list of files changes).

Build outputs go under build/ (ignored): the install's metadata, its folder of links, the
wheel's staging. Three stay where their tools put them, all ignored too: cargo's rust/target,
the core built in place as kvledger/_core.abi3.so (an editable install imports extensions from
beside their package), and the dashboard's chart library in serving/lookup/ui/vendor/ (package
data that a wheel must carry)."""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.editable_wheel import editable_wheel
from setuptools_rust import Binding, RustExtension


class StrictEditable(editable_wheel):
    """An editable install on the path, which nothing earlier on the path can shadow;
    `--config-settings editable_mode=...` still chooses another."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.mode = "strict"


class BuildExt(build_ext):
    """Names the core built in place among the build's outputs (the protocol setuptools
    asks of build steps), so that a strict editable install links it too."""

    def get_outputs(self) -> list[str]:
        return [*super().get_outputs(), *self._core_in_place()]

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), **self._core_in_place()}

    def _core_in_place(self) -> dict[str, str]:
        if not self.inplace:
            return {}
        rust = self.get_finalized_command("build_rust")
        linked = {}
        for ext in self.distribution.rust_extensions:
            built = Path(rust.get_dylib_ext_path(ext, ext.name))
            if built.is_file():  # an optional core that did not build is simply absent
                package = ext.name.split(".")[:-1]
                linked[str(Path(self.build_lib, *package, built.name))] = str(built.resolve())
        return linked


# Build outputs gather under build/, the install's metadata (egg_info) too, which setuptools
# wants to find there.
Path(__file__).resolve().parent.joinpath("build").mkdir(exist_ok=True)

setup(
    cmdclass={"build_ext": BuildExt, "editable_wheel": StrictEditable},
    rust_extensions=[
        RustExtension(
            "kvledger._core",
            path="rust/Cargo.toml",
            binding=Binding.PyO3,
            features=["extension-module"],
            py_limited_api=True,
            debug=False,  # editable installs too: a debug build is ~10x slower
            optional=os.environ.get("KVLEDGER_REQUIRE_CORE", "") in ("", "0"),
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}, "egg_info": {"egg_base": "build"}},
)
