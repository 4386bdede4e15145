"""The compiled core: one Rust crate (rust/, PyO3) built as the extension module
kvledger._core — the router's holder-mask table and the envelope's Avro coder. See
rust/README.md for what lives where and why.

It is built for CPython's stable ABI (abi3, 3.11 and later: one build serves every later
version). Where no Rust toolchain is found the build goes on without it (set
KVLEDGER_REQUIRE_CORE=1 to make that an error, as CI does): the router then uses its
pure-Python mask table and the codec fastavro, which answer identically; `kvledger
--version` says which is in use."""

import os

from setuptools import setup
from setuptools_rust import Binding, RustExtension

setup(
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
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
