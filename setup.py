"""The one compiled part: the router's holder-mask table (consumer/router/_masks.c).

Everything else is declared in pyproject.toml. The extension is optional: where no C
compiler is found the build goes on and the router uses the pure-Python table
(kvledger.consumer.router.masks says which one is in use)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvledger.consumer.router._masks",
            ["consumer/router/_masks.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
